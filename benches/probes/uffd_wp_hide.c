// Why `--isolation reset` does not track written pages by write-protection.
//
// userfaultfd's asynchronous write-protect mode (UFFD_FEATURE_WP_ASYNC,
// Linux 6.7) with PAGEMAP_SCAN finds the pages written since the last scan
// for about 10 ns a page, where the reset's own test (is the page still the
// snapshot's, and does it differ) walks each page's `struct page` and
// compares it. But the bit it reads is one the tracked process can set
// again itself: one PAGEMAP_SCAN with PM_SCAN_WP_MATCHING on its own
// /proc/self/pagemap, no userfaultfd fd needed, marks its written pages
// clean. A call would hide its writes from the put-back, and the next call
// would read them. (Soft-dirty bits, absent on this kernel, have the same
// flaw: a process clears its own through /proc/self/clear_refs.)
//
//     gcc -O2 -o /tmp/uffd_wp_hide benches/probes/uffd_wp_hide.c && /tmp/uffd_wp_hide
//
// Seen on Linux 6.18 (BENCHMARKS.md, "Why the put-back compares pages"):
//     after the snapshot: 0 written pages
//     the call wrote 3: the tracking sees 3
//     after the call re-protects them itself: the tracking sees 0; page 0 still holds 'S'
#define _GNU_SOURCE
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/userfaultfd.h>

struct page_region { uint64_t start, end, categories; };
struct pm_scan_arg { uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask, category_anyof_mask, return_mask; };
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PM_SCAN_WP_MATCHING (1 << 0)
#define PM_SCAN_CHECK_WPASYNC (1 << 1)
#define PAGE_IS_WRITTEN (1 << 1)
#define UFFD_FEATURE_WP_UNPOPULATED (1 << 13)
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1
#endif

#define N 64
static long written(int pm, char *a, int reprotect) {
  struct page_region v[N];
  struct pm_scan_arg arg = {.size = sizeof arg, .flags = reprotect ? PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC : 0,
    .start = (uint64_t)a, .end = (uint64_t)a + N * 4096, .vec = (uint64_t)v, .vec_len = N,
    .category_mask = PAGE_IS_WRITTEN, .return_mask = PAGE_IS_WRITTEN};
  long n = ioctl(pm, PAGEMAP_SCAN, &arg);
  if (n < 0) { perror("PAGEMAP_SCAN"); return -1; }
  long pages = 0; for (long i = 0; i < n; i++) pages += (v[i].end - v[i].start) / 4096;
  return pages;
}
int main(void) {
  int uffd = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
  if (uffd < 0) { perror("userfaultfd"); return 1; }
  struct uffdio_api api = {.api = UFFD_API, .features = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED};
  if (ioctl(uffd, UFFDIO_API, &api)) { perror("UFFDIO_API"); return 1; }
  char *a = mmap(0, N * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  memset(a, 1, N * 4096);
  struct uffdio_register reg = {.range = {(uint64_t)a, N * 4096}, .mode = UFFDIO_REGISTER_MODE_WP};
  if (ioctl(uffd, UFFDIO_REGISTER, &reg)) { perror("UFFDIO_REGISTER"); return 1; }
  int pm = open("/proc/self/pagemap", O_RDONLY);
  // The runtime's snapshot: every page write-protected (clean).
  written(pm, a, 1);
  printf("after the snapshot: %ld written pages\n", written(pm, a, 0));
  // The call writes 3 pages...
  a[0] = 'S'; a[5 * 4096] = 'E'; a[9 * 4096] = 'C';
  printf("the call wrote 3: the tracking sees %ld\n", written(pm, a, 0));
  // ...then, with no uffd fd, opens its own pagemap and write-protects them.
  int own = open("/proc/self/pagemap", O_RDONLY);
  written(own, a, 1);
  printf("after the call re-protects them itself: the tracking sees %ld; page 0 still holds '%c'\n",
         written(pm, a, 0), a[0]);
  return 0;
}
