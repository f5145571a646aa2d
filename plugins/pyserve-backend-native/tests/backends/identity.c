/* Test backend "identity": INPUTn -> OUTPUTn for every input, batching-aware.
 * Also exercises the backend config, logging, statistics, auto-complete (ModelSetConfig)
 * and response parameters. */
#include "backend_util.h"

TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  uint32_t major, minor;
  RETURN_IF_ERROR(TRITONBACKEND_ApiVersion(&major, &minor));
  if (major != 1 || minor < 19)
    return TRITONSERVER_ErrorNew(TRITONSERVER_ERROR_UNSUPPORTED, "needs TRITONBACKEND API 1.19");
  const char* name;
  RETURN_IF_ERROR(TRITONBACKEND_BackendName(backend, &name));
  TRITONSERVER_Message* config; /* owned by the backend object: not deleted */
  RETURN_IF_ERROR(TRITONBACKEND_BackendConfig(backend, &config));
  const char* json;
  size_t size;
  RETURN_IF_ERROR(TRITONSERVER_MessageSerializeToJson(config, &json, &size));
  char line[1024];
  snprintf(line, sizeof(line), "identity backend '%s' config %.*s", name, (int)size, json);
  TRITONSERVER_LogMessage(TRITONSERVER_LOG_INFO, __FILE__, __LINE__, line);
  return NULL;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  bool auto_complete;
  RETURN_IF_ERROR(TRITONBACKEND_ModelAutoCompleteConfig(model, &auto_complete));
  TRITONSERVER_Message* config;
  RETURN_IF_ERROR(TRITONBACKEND_ModelConfig(model, 1, &config));
  const char* json;
  size_t size;
  TRITONSERVER_Error* err = TRITONSERVER_MessageSerializeToJson(config, &json, &size);
  if (err == NULL && auto_complete) {
    /* Complete a config without outputs: one FP32 output named OUTPUT0. */
    const char* empty = "\"output\": []";
    const char* at = strstr(json, empty);
    if (at != NULL) {
      const char* full = "\"output\": [{\"name\": \"OUTPUT0\", \"data_type\": \"TYPE_FP32\", \"dims\": [-1]}]";
      size_t prefix = (size_t)(at - json);
      char* completed = malloc(size + strlen(full) + 1);
      memcpy(completed, json, prefix);
      strcpy(completed + prefix, full);
      strcat(completed, at + strlen(empty));
      TRITONSERVER_Message* updated;
      err = TRITONSERVER_MessageNewFromSerializedJson(&updated, completed, strlen(completed));
      if (err == NULL) {
        err = TRITONBACKEND_ModelSetConfig(model, 1, updated);
        TRITONSERVER_MessageDelete(updated); /* the caller keeps ownership */
      }
      free(completed);
    }
  }
  TRITONSERVER_MessageDelete(config); /* ModelConfig's message belongs to the caller */
  return err;
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  uint64_t exec_start = now_ns();
  uint64_t batch = 0;
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    TRITONBACKEND_Response* response;
    TRITONSERVER_Error* err = TRITONBACKEND_ResponseNew(&response, request);
    uint32_t inputs = 0;
    if (err == NULL) err = TRITONBACKEND_RequestInputCount(request, &inputs);
    for (uint32_t i = 0; err == NULL && i < inputs; i++) {
      TRITONBACKEND_Input* input;
      err = TRITONBACKEND_RequestInputByIndex(request, i, &input);
      if (err) break;
      const char* name;
      TRITONSERVER_DataType dtype;
      const int64_t* shape;
      uint32_t dims, buffers;
      uint64_t size;
      err = TRITONBACKEND_InputProperties(input, &name, &dtype, &shape, &dims, &size, &buffers);
      if (err) break;
      if (i == 0 && dims > 0) batch += (uint64_t)shape[0];
      char out_name[256];
      snprintf(out_name, sizeof(out_name), "OUTPUT%s", strncmp(name, "INPUT", 5) == 0 ? name + 5 : name);
      const void* data;
      uint64_t data_size;
      TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
      int64_t mid = 0;
      err = TRITONBACKEND_InputBuffer(input, 0, &data, &data_size, &mt, &mid);
      if (err == NULL) err = add_output(response, out_name, dtype, shape, dims, data, data_size);
    }
    if (err == NULL) err = TRITONBACKEND_ResponseSetIntParameter(response, "batch_requests", count);
    if (err != NULL) {
      TRITONBACKEND_ResponseDelete(response);
      send_error(request, err);
    } else {
      TRITONSERVER_Error* send_err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
      if (send_err) TRITONSERVER_ErrorDelete(send_err);
    }
    uint64_t t = now_ns();
    TRITONBACKEND_ModelInstanceReportStatistics(instance, request, true, exec_start, exec_start, t, t);
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  uint64_t end = now_ns();
  TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, batch ? batch : count, exec_start, exec_start, end, end);
  return NULL;
}
