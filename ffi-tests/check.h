/* Minimal test helpers for the C tests: CHECK, CHECK_STATUS, and a summary. */
#ifndef KVR_FFI_TESTS_CHECK_H
#define KVR_FFI_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "kvreplay.h"

static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        ++g_checks;                                                                  \
        if (!(cond)) {                                                               \
            ++g_failures;                                                            \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__,  \
                    __LINE__, #cond, kvr_error_last_message());                      \
        }                                                                            \
    } while (0)

#define CHECK_STATUS(expr, expected)                                                 \
    do {                                                                             \
        kvr_status s_ = (expr);                                                      \
        ++g_checks;                                                                  \
        if (s_ != (expected)) {                                                      \
            ++g_failures;                                                            \
            fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (%s); %s\n",     \
                    __FILE__, __LINE__, #expr, (int)s_, kvr_status_string(s_),           \
                    (int)(expected), kvr_status_string(expected),                       \
                    kvr_error_last_message());                                       \
        }                                                                            \
    } while (0)

static int finish(const char *name) {
    if (g_failures) {
        fprintf(stderr, "%s: %d of %d checks FAILED\n", name, g_failures, g_checks);
        return 1;
    }
    printf("%s: all %d checks passed\n", name, g_checks);
    return 0;
}

#endif
