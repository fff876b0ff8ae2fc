/* The C half of kvpush's UCP binding (transports/ucp.py): cffi's set_source() text, compiled in
   API mode against the headers of the UCX actually loaded. Not a standalone translation unit: cffi
   defines kvp_py_done and kvp_py_ep_error (extern "Python" in ucp.cdef). Package data, read at build
   time; a change here rebuilds the binding. */

#include <string.h>
#include <stdint.h>
#include <time.h>
#include <ucp/api/ucp.h>

static void kvp_py_done(void *user_data, ucs_status_t status);
static void kvp_py_ep_error(void *arg, ucs_status_t status);

static void kvp_flush_cb(void *request, ucs_status_t status, void *user_data) {
    kvp_py_done(user_data, status);
    ucp_request_free(request);
}

static void kvp_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    kvp_py_ep_error(arg, status);
}

static ucs_status_t kvp_open(int multi_thread, const char *tls, ucp_context_h *context, ucp_worker_h *worker,
                             int *efd) {
    ucp_config_t *config;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) return status;
    if (tls != NULL) {  /* this context only: the process environment is left alone */
        status = ucp_config_modify(config, "TLS", tls);
        if (status != UCS_OK) { ucp_config_release(config); return status; }
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    status = ucp_init(&params, config, context);
    ucp_config_release(config);
    if (status != UCS_OK) return status;
    ucp_worker_params_t wparams;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = multi_thread ? UCS_THREAD_MODE_MULTI : UCS_THREAD_MODE_SINGLE;
    status = ucp_worker_create(*context, &wparams, worker);
    if (status != UCS_OK) { ucp_cleanup(*context); return status; }
    status = ucp_worker_get_efd(*worker, efd);
    if (status != UCS_OK) { ucp_worker_destroy(*worker); ucp_cleanup(*context); }
    return status;
}

static ucs_status_t kvp_worker_address(ucp_worker_h worker, char *out, size_t *length) {
    ucp_address_t *address;
    size_t size;
    ucs_status_t status = ucp_worker_get_address(worker, &address, &size);
    if (status != UCS_OK) return status;
    if (size > *length) { ucp_worker_release_address(worker, address); return UCS_ERR_BUFFER_TOO_SMALL; }
    memcpy(out, address, size);
    *length = size;
    ucp_worker_release_address(worker, address);
    return UCS_OK;
}

static ucs_status_t kvp_ep_create(ucp_worker_h worker, const void *address, int peer_error_mode, void *arg,
                                  ucp_ep_h *ep) {
    ucp_ep_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = (const ucp_address_t *)address;
    params.err_mode = peer_error_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = kvp_err_cb;
    params.err_handler.arg = arg;
    return ucp_ep_create(worker, &params, ep);
}

/* Close without waiting for a peer that may be gone: progress for at most 200 ms. */
static void kvp_ep_close(ucp_worker_h worker, ucp_ep_h ep, int force) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
    if (request == NULL || UCS_PTR_IS_ERR(request)) return;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (ucp_request_check_status(request) == UCS_INPROGRESS) {
        ucp_worker_progress(worker);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((now.tv_sec - start.tv_sec) * 1000000000L + (now.tv_nsec - start.tv_nsec) > 200000000L) break;
    }
    ucp_request_free(request);  /* done, or left to finish on its own */
}

static ucs_status_t kvp_mem_map(ucp_context_h context, void *address, size_t length, ucp_mem_h *memh) {
    ucp_mem_map_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = address;
    params.length = length;
    return ucp_mem_map(context, &params, memh);
}

static ucs_status_t kvp_rkey_pack(ucp_context_h context, ucp_mem_h memh, char *out, size_t *length) {
    void *buffer;
    size_t size;
    ucs_status_t status = ucp_rkey_pack(context, memh, &buffer, &size);
    if (status != UCS_OK) return status;
    if (size > *length) { ucp_rkey_buffer_release(buffer); return UCS_ERR_BUFFER_TOO_SMALL; }
    memcpy(out, buffer, size);
    *length = size;
    ucp_rkey_buffer_release(buffer);
    return UCS_OK;
}

/* One layer: a put (or get) per iovec entry, then one flush whose callback reports completion.
   Returns 0 when everything completed inline, a negative ucs_status_t on error, 1 when the flush
   callback will report. Put/get requests are released at once: the flush covers them. */
static intptr_t kvp_rma_batch(ucp_ep_h ep, int is_get, const uint64_t *local_iov, const uint64_t *remote_iov,
                              const uint32_t *rkey_index, ucp_rkey_h *rkeys, size_t count, void *user_data) {
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    for (size_t i = 0; i < count; i++) {
        void *local = (void *)(uintptr_t)local_iov[2 * i];
        size_t length = (size_t)local_iov[2 * i + 1];
        uint64_t remote = remote_iov[2 * i];
        ucp_rkey_h rkey = rkeys[rkey_index[i]];
        ucs_status_ptr_t request = is_get ? ucp_get_nbx(ep, local, length, remote, rkey, &param)
                                          : ucp_put_nbx(ep, local, length, remote, rkey, &param);
        if (UCS_PTR_IS_ERR(request)) return (intptr_t)UCS_PTR_STATUS(request);
        if (request != NULL) ucp_request_free(request);
    }
    ucp_request_param_t flush;
    memset(&flush, 0, sizeof(flush));
    flush.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    flush.cb.send = kvp_flush_cb;
    flush.user_data = user_data;
    ucs_status_ptr_t request = ucp_ep_flush_nbx(ep, &flush);
    if (request == NULL) return 0;
    if (UCS_PTR_IS_ERR(request)) return (intptr_t)UCS_PTR_STATUS(request);
    return 1;
}
