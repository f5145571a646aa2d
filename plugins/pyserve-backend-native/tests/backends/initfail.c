/* Test backend "initfail": ModelInitialize fails. */
#include "backend_util.h"

TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  const char* name;
  RETURN_IF_ERROR(TRITONBACKEND_ModelName(model, &name));
  char message[256];
  snprintf(message, sizeof(message), "model '%s' refuses to load on purpose", name);
  return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INVALID_ARG, message);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  (void)instance; (void)requests; (void)count;
  return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_INTERNAL, "never reached");
}
