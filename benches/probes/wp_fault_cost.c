// What write-protect tracking costs a call: a fault on its first write to
// each page, against the cheaper scan it buys (BENCHMARKS.md, "Write-
// protect tracking, measured again").
//
// N pages of a memfd's private mapping, all present, W of them written
// each round; then the put-back's scan: for private copies (mode 0, what
// the reset does) or, with the mapping registered with a userfaultfd in
// asynchronous write-protect mode and every page protected, for the pages
// written since the last scan, protected again by the same scan (mode 1).
//
//     gcc -O2 -o /tmp/wp_cost benches/probes/wp_fault_cost.c
//     /tmp/wp_cost 1000 80 0; /tmp/wp_cost 1000 80 1
//
// Seen on Linux 6.18, 2 vCPU AMD EPYC (300 rounds):
//     pages 1000 written 80 mode 0: writes 0.9 us (0.01 us/page), scan 50.8 us
//     pages 20000 written 1000 mode 0: writes 15.4 us (0.02 us/page), scan 881.4 us
//     pages 1000 written 80 mode 1: writes 166.7 us (2.08 us/page), scan 13.4 us
//     pages 20000 written 1000 mode 1: writes 2025.2 us (2.03 us/page), scan 138.5 us
#define _GNU_SOURCE
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/userfaultfd.h>
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1<<15)
#endif
#ifndef UFFD_FEATURE_WP_UNPOPULATED
#define UFFD_FEATURE_WP_UNPOPULATED (1<<13)
#endif
#include "pagemap_scan.h"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static struct page_region v[4096];
static long scan(int fd,char*p,long n,int written){
  struct pm_scan_arg a; memset(&a,0,sizeof a);a.size=sizeof a;a.start=(uint64_t)p;a.end=(uint64_t)p+n*4096;a.vec=(uint64_t)v;a.vec_len=4096;
  if(written){a.flags=PM_SCAN_WP_MATCHING|PM_SCAN_CHECK_WPASYNC;a.category_mask=PAGE_IS_WRITTEN;a.return_mask=PAGE_IS_WRITTEN;}
  else {a.category_inverted=PAGE_IS_FILE;a.category_mask=PAGE_IS_FILE;a.category_anyof_mask=PAGE_IS_PRESENT|PAGE_IS_SWAPPED;a.return_mask=PAGE_IS_PRESENT|PAGE_IS_FILE;}
  long f=ioctl(fd,PAGEMAP_SCAN,&a); if(f<0){perror("scan");exit(1);} return f;
}
int main(int argc,char**argv){
  long n=atol(argv[1]); long w=atol(argv[2]); int mode=atoi(argv[3]); // mode 0: file/present scan; 1: uffd wp async
  int mfd=memfd_create("x",0); ftruncate(mfd,n*4096);
  char*p=mmap(0,n*4096,PROT_READ|PROT_WRITE,MAP_PRIVATE,mfd,0);
  volatile char s=0; for(long i=0;i<n;i++) s+=p[i*4096]; // all present (read)
  int fd=open("/proc/self/pagemap",O_RDONLY);
  if(mode){
    int u=syscall(SYS_userfaultfd,O_CLOEXEC|1);
    struct uffdio_api api={.api=UFFD_API,.features=UFFD_FEATURE_WP_ASYNC|UFFD_FEATURE_WP_UNPOPULATED};
    if(ioctl(u,UFFDIO_API,&api)){perror("api");return 1;}
    struct uffdio_register reg={.range={(uint64_t)p,n*4096},.mode=UFFDIO_REGISTER_MODE_WP};
    if(ioctl(u,UFFDIO_REGISTER,&reg)){perror("register");return 1;}
    struct uffdio_writeprotect wp={.range={(uint64_t)p,n*4096},.mode=UFFDIO_WRITEPROTECT_MODE_WP};
    if(ioctl(u,UFFDIO_WRITEPROTECT,&wp)){perror("wp");return 1;}
  }
  // warm: first writes make private copies (COW) once
  for(long i=0;i<w;i++) p[(i*(n/w))*4096]=1;
  scan(fd,p,n,mode);
  int R=300; double tw=0,ts=0; long f=0;
  for(int r=0;r<R;r++){
    double t0=now();
    for(long i=0;i<w;i++) p[(i*(n/w))*4096]=(char)r;
    double t1=now();
    f=scan(fd,p,n,mode);
    double t2=now();
    tw+=t1-t0; ts+=t2-t1;
  }
  printf("pages %ld written %ld mode %d: writes %.1f us (%.2f us/page), scan %.1f us, found %ld ranges\n",n,w,mode,tw/R,tw/R/w,ts/R,f);
}
