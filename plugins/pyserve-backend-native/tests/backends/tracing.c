/* Test backend "tracing": OUTPUT0 = INPUT0, and a STRING response parameter "report" (JSON)
 * with what it saw of the newer API:
 *  - the request's trace (TRITONBACKEND_RequestTrace): its id, parent id, model, version,
 *    request id and context; it reports custom activities WORK_START, MARK, WORK_END on it;
 *  - a BLS call to model "ident" with a child of that trace, and one with a trace of its own
 *    (TRITONSERVER_InferenceTraceNew) whose activity callback collects the activities;
 *  - the hosting server: live, ready, metadata, index, statistics, metrics, API version;
 *  - ServerOptions and ServerNew (refused).
 * A request whose id is "load:<model>" or "unload:<model>" instead loads or unloads that model
 * (TRITONSERVER_ServerLoadModel / UnloadModel) and reports {"control": "<error code>" or "ok"}.
 * Every model of this backend sends BLS requests to "ident". */
#include <pthread.h>

#include "backend_util.h"

typedef struct call {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  bool released, final, trace_released;
  char activities[512]; /* names from the user trace's activity callback, comma-separated */
} call;

static TRITONSERVER_Error* alloc_fn(
    TRITONSERVER_ResponseAllocator* allocator, const char* tensor_name, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id, void* userp, void** buffer,
    void** buffer_userp, TRITONSERVER_MemoryType* actual_memory_type, int64_t* actual_memory_type_id) {
  (void)allocator; (void)tensor_name; (void)memory_type; (void)memory_type_id; (void)userp;
  *buffer = malloc(byte_size ? byte_size : 1);
  *buffer_userp = NULL;
  *actual_memory_type = TRITONSERVER_MEMORY_CPU;
  *actual_memory_type_id = 0;
  return NULL;
}

static TRITONSERVER_Error* free_fn(
    TRITONSERVER_ResponseAllocator* allocator, void* buffer, void* buffer_userp, size_t byte_size,
    TRITONSERVER_MemoryType memory_type, int64_t memory_type_id) {
  (void)allocator; (void)buffer_userp; (void)byte_size; (void)memory_type; (void)memory_type_id;
  free(buffer);
  return NULL;
}

static void signal_call(call* c, bool* flag) {
  pthread_mutex_lock(&c->lock);
  *flag = true;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
}

static void request_released(TRITONSERVER_InferenceRequest* request, const uint32_t flags, void* userp) {
  (void)request;
  if (flags & TRITONSERVER_REQUEST_RELEASE_ALL) signal_call(userp, &((call*)userp)->released);
}

static void response_complete(TRITONSERVER_InferenceResponse* response, const uint32_t flags, void* userp) {
  if (response != NULL) TRITONSERVER_InferenceResponseDelete(response);
  if (flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL) signal_call(userp, &((call*)userp)->final);
}

static void trace_activity(TRITONSERVER_InferenceTrace* trace, TRITONSERVER_InferenceTraceActivity activity,
                           uint64_t timestamp_ns, void* userp) {
  (void)trace; (void)timestamp_ns;
  call* c = userp;
  size_t n = strlen(c->activities);
  snprintf(c->activities + n, sizeof(c->activities) - n, "%s\"%s\"", n ? "," : "",
           TRITONSERVER_InferenceTraceActivityString(activity));
}

static void trace_released(TRITONSERVER_InferenceTrace* trace, void* userp) {
  TRITONSERVER_InferenceTraceDelete(trace); /* the release callback gives it back to us */
  signal_call(userp, &((call*)userp)->trace_released);
}

/* Calls "ident" with INPUT0 and waits for the final response, the release and (with a user
 * trace) the trace's release. */
static TRITONSERVER_Error* call_ident(
    TRITONSERVER_Server* server, TRITONSERVER_ResponseAllocator* allocator, TRITONBACKEND_Request* request,
    TRITONSERVER_InferenceTrace* trace, call* c, bool user_trace) {
  const void* data;
  uint64_t size;
  TRITONSERVER_DataType dtype;
  const int64_t* shape;
  uint32_t dims;
  RETURN_IF_ERROR(input_data(request, "INPUT0", &data, &size, &dtype, &shape, &dims));
  TRITONSERVER_InferenceRequest* ireq;
  RETURN_IF_ERROR(TRITONSERVER_InferenceRequestNew(&ireq, server, "ident", -1));
  TRITONSERVER_Error* err = TRITONSERVER_InferenceRequestAddInput(ireq, "INPUT0", dtype, shape, dims);
  if (!err) err = TRITONSERVER_InferenceRequestAppendInputData(ireq, "INPUT0", data, size, TRITONSERVER_MEMORY_CPU, 0);
  if (!err) err = TRITONSERVER_InferenceRequestSetReleaseCallback(ireq, request_released, c);
  if (!err) err = TRITONSERVER_InferenceRequestSetResponseCallback(ireq, allocator, NULL, response_complete, c);
  if (!err) err = TRITONSERVER_ServerInferAsync(server, ireq, trace); /* takes the trace in any case */
  if (err) {
    TRITONSERVER_InferenceRequestDelete(ireq);
    return err;
  }
  pthread_mutex_lock(&c->lock);
  while (!(c->released && c->final && (c->trace_released || !user_trace))) pthread_cond_wait(&c->cond, &c->lock);
  pthread_mutex_unlock(&c->lock);
  return TRITONSERVER_InferenceRequestDelete(ireq);
}

static TRITONSERVER_Error* message_text(TRITONSERVER_Message* message, char* out, size_t cap) {
  const char* base;
  size_t size;
  RETURN_IF_ERROR(TRITONSERVER_MessageSerializeToJson(message, &base, &size));
  snprintf(out, cap, "%.*s", (int)size, base);
  return TRITONSERVER_MessageDelete(message);
}

/* What the hosting server says about itself, as JSON members. */
static TRITONSERVER_Error* server_report(TRITONSERVER_Server* server, char* out, size_t cap) {
  bool live = false, ready = false;
  RETURN_IF_ERROR(TRITONSERVER_ServerIsLive(server, &live));
  RETURN_IF_ERROR(TRITONSERVER_ServerIsReady(server, &ready));
  char metadata[1024], index[2048], stats[8192];
  TRITONSERVER_Message* message;
  RETURN_IF_ERROR(TRITONSERVER_ServerMetadata(server, &message));
  RETURN_IF_ERROR(message_text(message, metadata, sizeof(metadata)));
  RETURN_IF_ERROR(TRITONSERVER_ServerModelIndex(server, TRITONSERVER_INDEX_FLAG_READY, &message));
  RETURN_IF_ERROR(message_text(message, index, sizeof(index)));
  RETURN_IF_ERROR(TRITONSERVER_ServerModelStatistics(server, "ident", -1, &message));
  RETURN_IF_ERROR(message_text(message, stats, sizeof(stats)));
  TRITONSERVER_Metrics* metrics;
  RETURN_IF_ERROR(TRITONSERVER_ServerMetrics(server, &metrics));
  const char* text;
  size_t text_size;
  RETURN_IF_ERROR(TRITONSERVER_MetricsFormatted(metrics, TRITONSERVER_METRIC_PROMETHEUS, &text, &text_size));
  bool has_count = strstr(text, "nv_inference_count{") != NULL;
  RETURN_IF_ERROR(TRITONSERVER_MetricsDelete(metrics));
  uint32_t major, minor;
  RETURN_IF_ERROR(TRITONSERVER_ApiVersion(&major, &minor));
  TRITONSERVER_ServerOptions* options;
  RETURN_IF_ERROR(TRITONSERVER_ServerOptionsNew(&options));
  RETURN_IF_ERROR(TRITONSERVER_ServerOptionsSetModelRepositoryPath(options, "/models"));
  TRITONSERVER_Server* other = NULL;
  TRITONSERVER_Error* refused = TRITONSERVER_ServerNew(&other, options);
  TRITONSERVER_ServerOptionsDelete(options);
  TRITONSERVER_Error* stop = TRITONSERVER_ServerStop(server);
  snprintf(out, cap,
           "\"live\": %d, \"ready\": %d, \"metadata\": %s, \"index\": %s, \"stats\": %s, \"metrics_count\": %d, "
           "\"api\": \"%u.%u\", \"server_new\": \"%s\", \"server_stop\": \"%s\"",
           live, ready, metadata, index, stats, has_count, major, minor,
           refused ? TRITONSERVER_ErrorCodeString(refused) : "ok", stop ? TRITONSERVER_ErrorCodeString(stop) : "ok");
  TRITONSERVER_ErrorDelete(refused);
  TRITONSERVER_ErrorDelete(stop);
  return NULL;
}

/* The request's trace and the two traced BLS calls, as JSON members. */
static TRITONSERVER_Error* trace_report(
    TRITONSERVER_Server* server, TRITONSERVER_ResponseAllocator* allocator, TRITONBACKEND_Request* request,
    char* out, size_t cap) {
  TRITONSERVER_InferenceTrace* trace;
  RETURN_IF_ERROR(TRITONBACKEND_RequestTrace(request, &trace));
  call user = {.released = false};
  pthread_mutex_init(&user.lock, NULL);
  pthread_cond_init(&user.cond, NULL);
  TRITONSERVER_InferenceTrace* own;
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceNew(&own, TRITONSERVER_TRACE_LEVEL_TIMESTAMPS, 0, trace_activity,
                                                 trace_released, &user));
  uint64_t own_id = 0;
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceId(own, &own_id));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceReportActivity(own, now_ns(), "BEFORE_CALL"));
  RETURN_IF_ERROR(call_ident(server, allocator, request, own, &user, true));
  if (trace == NULL) {
    snprintf(out, cap, "\"traced\": 0, \"own_id\": %llu, \"own_activities\": [%s], \"own_released\": %d",
             (unsigned long long)own_id, user.activities, user.trace_released);
    return NULL;
  }
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceReportActivity(trace, now_ns(), "WORK_START"));
  uint64_t id, parent_id;
  const char *model, *request_id, *context;
  int64_t version;
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceId(trace, &id));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceParentId(trace, &parent_id));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceModelName(trace, &model));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceModelVersion(trace, &version));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceRequestId(trace, &request_id));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceContext(trace, &context));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceReportActivity(trace, now_ns(), "MARK"));
  TRITONSERVER_InferenceTrace* child;
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceSpawnChildTrace(trace, &child));
  uint64_t child_id = 0, child_parent = 0;
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceId(child, &child_id));
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceParentId(child, &child_parent));
  call child_call = {.released = false};
  pthread_mutex_init(&child_call.lock, NULL);
  pthread_cond_init(&child_call.cond, NULL);
  RETURN_IF_ERROR(call_ident(server, allocator, request, child, &child_call, false));
  TRITONSERVER_Error* not_ours = TRITONSERVER_InferenceTraceDelete(trace); /* the request's: refused */
  RETURN_IF_ERROR(TRITONSERVER_InferenceTraceReportActivity(trace, now_ns(), "WORK_END"));
  snprintf(out, cap,
           "\"traced\": 1, \"id\": %llu, \"parent_id\": %llu, \"model\": \"%s\", \"version\": %lld, "
           "\"request_id\": \"%s\", \"context\": %s, \"child_id\": %llu, \"child_parent\": %llu, "
           "\"delete_request_trace\": \"%s\", \"own_id\": %llu, \"own_activities\": [%s], \"own_released\": %d",
           (unsigned long long)id, (unsigned long long)parent_id, model, (long long)version, request_id,
           context ? context : "null", (unsigned long long)child_id, (unsigned long long)child_parent,
           not_ours ? TRITONSERVER_ErrorCodeString(not_ours) : "ok", (unsigned long long)own_id, user.activities,
           user.trace_released);
  TRITONSERVER_ErrorDelete(not_ours);
  return NULL;
}

/* A counter named without "_total" (as Triton's identity backend names its own). */
static TRITONSERVER_MetricFamily* g_family;
static TRITONSERVER_Metric* g_requests;

TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  RETURN_IF_ERROR(TRITONSERVER_MetricFamilyNew(&g_family, TRITONSERVER_METRIC_KIND_COUNTER, "traced_requests",
                                               "Requests the tracing backend executed"));
  TRITONSERVER_Parameter* label = TRITONSERVER_ParameterNew("backend", TRITONSERVER_PARAMETER_STRING, "tracing");
  const TRITONSERVER_Parameter* labels[1] = {label};
  TRITONSERVER_Error* err = TRITONSERVER_MetricNew(&g_requests, g_family, labels, 1);
  TRITONSERVER_ParameterDelete(label);
  return err;
}

TRITONSERVER_Error* TRITONBACKEND_Finalize(TRITONBACKEND_Backend* backend) {
  (void)backend;
  TRITONSERVER_MetricDelete(g_requests);
  return TRITONSERVER_MetricFamilyDelete(g_family);
}

TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests, const uint32_t count) {
  TRITONBACKEND_Model* model;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  TRITONSERVER_Server* server;
  RETURN_IF_ERROR(TRITONBACKEND_ModelServer(model, &server));
  TRITONSERVER_ResponseAllocator* allocator;
  RETURN_IF_ERROR(TRITONSERVER_ResponseAllocatorNew(&allocator, alloc_fn, free_fn, NULL));
  char traces[2048], health[16384], report[20000];
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request* request = requests[r];
    TRITONSERVER_MetricIncrement(g_requests, 1);
    const char* id = "";
    TRITONSERVER_Error* err = TRITONBACKEND_RequestId(request, &id);
    bool load = strncmp(id, "load:", 5) == 0, unload = strncmp(id, "unload:", 7) == 0;
    if (!err && (load || unload)) {
      TRITONSERVER_Error* done = load ? TRITONSERVER_ServerLoadModel(server, id + 5)
                                      : TRITONSERVER_ServerUnloadModel(server, id + 7);
      if (done) TRITONSERVER_LogMessage(TRITONSERVER_LOG_WARN, __FILE__, __LINE__, TRITONSERVER_ErrorMessage(done));
      snprintf(traces, sizeof(traces), "\"control\": \"%s\"", done ? TRITONSERVER_ErrorCodeString(done) : "ok");
      TRITONSERVER_ErrorDelete(done);
      snprintf(health, sizeof(health), "\"id\": \"%s\"", id);
    } else {
      if (!err) err = trace_report(server, allocator, request, traces, sizeof(traces));
      if (!err) err = server_report(server, health, sizeof(health));
    }
    TRITONBACKEND_Response* response = NULL;
    if (!err) err = TRITONBACKEND_ResponseNew(&response, request);
    const void* data;
    uint64_t size;
    TRITONSERVER_DataType dtype;
    const int64_t* shape;
    uint32_t dims;
    if (!err) err = input_data(request, "INPUT0", &data, &size, &dtype, &shape, &dims);
    if (!err) err = add_output(response, "OUTPUT0", dtype, shape, dims, data, size);
    snprintf(report, sizeof(report), "{%s, %s}", traces, health);
    if (!err) err = TRITONBACKEND_ResponseSetStringParameter(response, "report", report);
    if (!err) err = TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, NULL);
    if (err) {
      if (response) TRITONBACKEND_ResponseDelete(response);
      send_error(request, err);
    }
    TRITONBACKEND_RequestRelease(request, TRITONSERVER_REQUEST_RELEASE_ALL);
  }
  return TRITONSERVER_ResponseAllocatorDelete(allocator);
}
