/* vgcheck_bugs.c — deliberately buggy: run under valgrind memcheck by
 * run.sh, which expects memcheck to report each bug below. It proves the
 * debug build's annotations tell memcheck where hakmem's blocks are (without
 * them memcheck sees only mapped memory and reports nothing). Not a test_*
 * program: run natively it proves nothing, and it is never run natively. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
  volatile char sink = 0;
  /* 1. read after free (small class) */
  char* a = malloc(64);
  memset(a, 1, 64);
  free(a);
  sink += a[10];
  /* 2. write past the usable size (64-byte class) */
  char* b = malloc(64);
  b[64 + 8] = 1;     /* lands in the next block, which memcheck knows is not b */
  /* 3. branch on uninitialized heap memory */
  int* c = malloc(sizeof(int) * 4);
  if (c[2] == 42) sink++;
  /* 4. read after free of a huge object */
  char* d = malloc(3 << 20);
  d[0] = 1;
  free(d);
  sink += d[100];
  free(b);
  free(c);
  printf("vgcheck_bugs done %d\n", (int)sink);
  return 0;
}
