/* Helpers shared by pyserve's C test backends (compiled by the tests against triton_shim.h). */
#ifndef PYSERVE_TEST_BACKEND_UTIL_H
#define PYSERVE_TEST_BACKEND_UTIL_H

#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "triton_shim.h"

#define RETURN_IF_ERROR(expr)               \
  do {                                      \
    TRITONSERVER_Error* err__ = (expr);     \
    if (err__ != NULL) return err__;        \
  } while (0)

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Sends 'err' as the request's only response (ownership of err stays here: deleted). */
static inline void send_error(TRITONBACKEND_Request* request, TRITONSERVER_Error* err) {
  TRITONBACKEND_Response* response;
  if (TRITONBACKEND_ResponseNew(&response, request) == NULL) {
    TRITONSERVER_Error* send_err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, err);
    if (send_err) TRITONSERVER_ErrorDelete(send_err);
  }
  TRITONSERVER_ErrorDelete(err);
}

/* Reads the first buffer of an input. */
static inline TRITONSERVER_Error* input_data(
    TRITONBACKEND_Request* request, const char* name, const void** data, uint64_t* size,
    TRITONSERVER_DataType* dtype, const int64_t** shape, uint32_t* dims) {
  TRITONBACKEND_Input* input;
  RETURN_IF_ERROR(TRITONBACKEND_RequestInput(request, name, &input));
  uint32_t buffers;
  RETURN_IF_ERROR(TRITONBACKEND_InputProperties(input, NULL, dtype, shape, dims, size, &buffers));
  TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
  int64_t mid = 0;
  uint64_t bsize;
  return TRITONBACKEND_InputBuffer(input, 0, data, &bsize, &mt, &mid);
}

/* Adds an output to 'response' and copies 'size' bytes of 'data' into it. */
static inline TRITONSERVER_Error* add_output(
    TRITONBACKEND_Response* response, const char* name, TRITONSERVER_DataType dtype,
    const int64_t* shape, uint32_t dims, const void* data, uint64_t size) {
  TRITONBACKEND_Output* output;
  RETURN_IF_ERROR(TRITONBACKEND_ResponseOutput(response, &output, name, dtype, shape, dims));
  void* buffer;
  TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
  int64_t mid = 0;
  RETURN_IF_ERROR(TRITONBACKEND_OutputBuffer(output, &buffer, size, &mt, &mid));
  if (size) memcpy(buffer, data, size);
  return NULL;
}

#endif
