// How fast the kernel copies a file's bytes into a new file, by method and by where the bytes sit
// within a page: the floor under any tool that writes a format whose payload does not start on a
// page boundary (a safetensors file's tensors start right after its JSON header; a ZeRO shard's
// tensors sit 64-byte aligned inside a ZIP archive), next to what `cp` does (one page-aligned
// copy_file_range).
//
//   gcc -O2 -o /tmp/copy_alignment benchmarks/copy_alignment.c
//   /tmp/copy_alignment SRC DST SRC_OFFSET DST_OFFSET METHOD     # METHOD: 0 copy_file_range, 1 pwrite from mmap
//
// Copies SRC's bytes from SRC_OFFSET (all but its last 8 KiB) to DST at DST_OFFSET in 4 MiB
// windows (pyckpt's executor window), the pwrite method in 256 KiB slices (its slice), on one thread.
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s SRC DST SRC_OFFSET DST_OFFSET METHOD(0|1)\n", argv[0]);
        return 2;
    }
    const char *src = argv[1], *dst = argv[2];
    const long src_off = atol(argv[3]), dst_off = atol(argv[4]);
    const int method = atoi(argv[5]);
    int in = open(src, O_RDONLY);
    struct stat st;
    if (in < 0 || fstat(in, &st) != 0) { perror(src); return 1; }
    const long size = st.st_size - 8192 - src_off;
    unlink(dst);
    const double t0 = now();
    int out = open(dst, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (out < 0 || ftruncate(out, size + dst_off) != 0) { perror(dst); return 1; }
    const long window = 4L << 20, slice = 256L << 10;
    unsigned char* map = mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, in, 0);
    if (map == MAP_FAILED) { perror("mmap"); return 1; }
    for (long o = 0; o < size; o += window) {
        const long n = size - o < window ? size - o : window;
        if (method == 0) {
            loff_t a = src_off + o, b = dst_off + o;
            for (long done = 0; done < n;) {
                ssize_t r = copy_file_range(in, &a, out, &b, n - done, 0);
                if (r <= 0) { perror("copy_file_range"); return 1; }
                done += r;
            }
        } else {
            for (long at = 0; at < n; at += slice) {
                const long k = n - at < slice ? n - at : slice;
                if (pwrite(out, map + src_off + o + at, k, dst_off + o + at) != k) { perror("pwrite"); return 1; }
            }
        }
    }
    if (close(out) != 0) { perror("close"); return 1; }
    printf("%s src_off %ld dst_off %ld: %.3f s\n", method == 0 ? "copy_file_range" : "pwrite from mmap", src_off,
           dst_off, now() - t0);
    return 0;
}
