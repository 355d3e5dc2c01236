// What one PAGEMAP_SCAN over every region would save, and why the reset
// does not do it (BENCHMARKS.md, "one scan for every region").
//
// A put-back scans each snapshot region by itself: ~2.5 us a scan before
// it walks a page, and a scan across the span of all the regions would
// walk the code between them page by page. The kernel skips a mapping
// whole where the scan asks for mappings registered with a userfaultfd in
// asynchronous write-protect mode (PAGE_IS_WPALLOWED). This probe maps N
// small regions of a memfd (16 pages, two written) between read-only file
// mappings, and times N scans (mode 0) against one over the span with the
// regions so registered (mode 1). The registration is what the reset
// cannot afford: a mapping so registered takes write-protection from
// PAGEMAP_SCAN with PM_SCAN_WP_MATCHING on the process's own pagemap,
// and those bits outlive a put-back (tests/reset.rs:
// no_call_leaves_pages_write_protected_for_a_later_call_to_read).
//
//     gcc -O2 -o /tmp/one_scan benches/probes/one_scan_registered.c
//     /tmp/one_scan 44 0; /tmp/one_scan 44 1
//
// Seen on Linux 6.18, 2 vCPU AMD EPYC:
//     regions 44 uffd 0: 150.25 us/scan found 88
//     regions 44 uffd 1: 56.63 us/scan found 88
#define _GNU_SOURCE
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/userfaultfd.h>
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1<<15)
#endif
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif
#include "pagemap_scan.h"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc, char **argv) {
  int nreg=atoi(argv[1]); int use=atoi(argv[2]);
  long npages=16; 
  int mfd=memfd_create("x",0); ftruncate(mfd,nreg*npages*4096);
  // regions separated by a file-backed code-like mapping with many present pages
  int lib=open("/usr/lib/x86_64-linux-gnu/libc.so.6",O_RDONLY);
  char* base=mmap(0,(size_t)nreg*2*64*4096,PROT_NONE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  char* regs[4096];
  for(int r=0;r<nreg;r++){
    char* at=base+(size_t)r*2*64*4096;
    regs[r]=mmap(at,npages*4096,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_FIXED,mfd,r*npages*4096);
    char* code=mmap(at+64*4096,48*4096,PROT_READ,MAP_PRIVATE|MAP_FIXED,lib,0);
    volatile char s=0; for(int i=0;i<48;i++) s+=code[i*4096];
    for(int i=0;i<npages;i++) s+=regs[r][i*4096];
    regs[r][0]=1; regs[r][5*4096]=1;
  }
  if(use){
    int u=syscall(SYS_userfaultfd,O_CLOEXEC|UFFD_USER_MODE_ONLY);
    if(u<0){perror("userfaultfd");return 1;}
    struct uffdio_api api={.api=UFFD_API,.features=UFFD_FEATURE_WP_ASYNC};
    if(ioctl(u,UFFDIO_API,&api)){perror("api");return 1;}
    for(int r=0;r<nreg;r++){
      struct uffdio_register reg={.range={(uint64_t)regs[r],npages*4096},.mode=UFFDIO_REGISTER_MODE_WP};
      if(ioctl(u,UFFDIO_REGISTER,&reg)){perror("register");return 1;}
    }
  }
  int fd=open("/proc/self/pagemap",O_RDONLY);
  struct page_region v[4096];
  struct pm_scan_arg a; int n=2000; long f=0; double t=now();
  for(int i=0;i<n;i++){
    if(use){
      memset(&a,0,sizeof a);a.size=sizeof a;a.start=(uint64_t)base;a.end=(uint64_t)base+(size_t)nreg*2*64*4096;a.vec=(uint64_t)v;a.vec_len=4096;
      a.category_inverted=PAGE_IS_FILE;a.category_mask=PAGE_IS_FILE|PAGE_IS_WPALLOWED;a.category_anyof_mask=PAGE_IS_PRESENT|PAGE_IS_SWAPPED;a.return_mask=PAGE_IS_PRESENT;
      f=ioctl(fd,PAGEMAP_SCAN,&a); if(f<0){perror("scan");return 1;}
    } else {
      f=0;
      for(int r=0;r<nreg;r++){
      memset(&a,0,sizeof a);a.size=sizeof a;a.start=(uint64_t)regs[r];a.end=(uint64_t)regs[r]+npages*4096;a.vec=(uint64_t)v;a.vec_len=4096;
      a.category_inverted=PAGE_IS_FILE;a.category_mask=PAGE_IS_FILE;a.category_anyof_mask=PAGE_IS_PRESENT|PAGE_IS_SWAPPED;a.return_mask=PAGE_IS_PRESENT;
      f+=ioctl(fd,PAGEMAP_SCAN,&a);}
    }
  }
  printf("regions %d uffd %d: %.2f us/scan found %ld (first %lx-%lx)\n",nreg,use,(now()-t)/n,f,(long)v[0].start,(long)v[0].end);
}
