/* A floor under the stack sizes threads ask for.
 *
 * civetweb (the HTTP server inside prometheus-cpp's Exposer) starts its threads with a fixed
 * 100 KiB stack (USE_STACK_SIZE=102400 in Debian's build). glibc places every thread's static TLS
 * on its stack, and a worker process carries more than that: OpenBLAS alone brings 60 KiB,
 * glog 30 KiB, libtorch 10 KiB. pthread_create then fails with EINVAL and /metrics cannot start.
 * No option of civetweb or prometheus-cpp changes that stack size, so the executable interposes
 * pthread_attr_setstacksize and raises requests below 1 MiB to 1 MiB (larger ones pass through).
 * Linked into moelora-worker only, with the symbol exported (see worker/CMakeLists.txt).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>

typedef int (*SetStackSizeFn)(pthread_attr_t*, size_t);

int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  static SetStackSizeFn real = NULL;
  if (real == NULL) real = (SetStackSizeFn)dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
  const size_t kFloor = (size_t)1 << 20;
  return real(attr, size < kFloor ? kFloor : size);
}
