// PAGEMAP_SCAN (Linux 6.7), as linux/fs.h has it where the C library's
// headers are older: the probes' one copy.
#include <stdint.h>

struct page_region { uint64_t start, end, categories; };
struct pm_scan_arg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
  uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
#define PAGEMAP_SCAN 0xc0606610
#define PM_SCAN_WP_MATCHING (1 << 0)
#define PM_SCAN_CHECK_WPASYNC (1 << 1)
#define PAGE_IS_WPALLOWED (1 << 0)
#define PAGE_IS_WRITTEN (1 << 1)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
