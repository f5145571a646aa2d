/* Test backend "errors": OUTPUT0 = 2 * INPUT0 (INT32), with failures on purpose:
 * a request with id "fail-batch" fails the whole execute (the execute returns an error);
 * a negative first element gets a per-request error response; 0 gets no response at all
 * (the request is released without one). A request with id "not-ready" makes
 * TRITONBACKEND_ModelInstanceReady fail from then on; one with id "ready" undoes it. */
#include "backend_util.h"

static volatile int not_ready = 0;

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceReady(TRITONBACKEND_ModelInstance* instance) {
  (void)instance;
  return not_ready ? TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_UNAVAILABLE, "not ready on purpose") : NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  for (uint32_t r = 0; r < count; r++) {
    const char* id;
    RETURN_IF_ERROR(TRITONBACKEND_RequestId(requests[r], &id));
    if (strcmp(id, "fail-batch") == 0) /* requests stay with the server */
      return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "the batch was rejected on purpose");
    if (strcmp(id, "not-ready") == 0) not_ready = 1;
    if (strcmp(id, "ready") == 0) not_ready = 0;
  }
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    const void* data;
    uint64_t size;
    TRITONSERVER_DataType dtype;
    const int64_t* shape;
    uint32_t dims;
    TRITONSERVER_Error* err = input_data(request, "INPUT0", &data, &size, &dtype, &shape, &dims);
    if (err == NULL && (dtype != TRITONSERVER_TYPE_INT32 || size < 4))
      err = TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, "INPUT0 must hold INT32 values");
    if (err != NULL) {
      send_error(request, err);
    } else {
      const int32_t* values = data;
      if (values[0] < 0) {
        char message[128];
        snprintf(message, sizeof(message), "negative input %d is not allowed", values[0]);
        send_error(request, TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, message));
      } else if (values[0] > 0) {
        size_t n = size / 4;
        int32_t* doubled = malloc(size);
        for (size_t i = 0; i < n; i++) doubled[i] = values[i] * 2;
        TRITONBACKEND_Response* response;
        err = TRITONBACKEND_ResponseNew(&response, request);
        if (err == NULL) err = add_output(response, "OUTPUT0", dtype, shape, dims, doubled, size);
        free(doubled);
        if (err == NULL) err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
        if (err != NULL) TRITONSERVER_ErrorDelete(err);
      } /* 0: no response */
    }
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  (void)instance;
  return NULL;
}
