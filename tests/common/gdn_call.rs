//! One call of the GDN pool's decode or verify entry point; shared by the tests and the
//! API-sequence harnesses (fuzz/api/).

use kvreplay::ffi::*;

/// `kvr_gdn_pool_verify` when `verify`, else `kvr_gdn_pool_decode`, on the tensors in
/// argument order (q, k, v, g, beta, conv_in, out; null where one is left out), with no
/// event to record.
pub fn gdn_pool_call(
    pool: *mut kvr_gdn_pool,
    layer: i32,
    ids: *const kvr_tensor,
    verify: bool,
    t: [*const kvr_tensor; 7],
    params: *const kvr_gdn_step_params,
) -> kvr_status {
    let f = if verify {
        kvr_gdn_pool_verify
    } else {
        kvr_gdn_pool_decode
    };
    f(
        pool,
        layer,
        ids,
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
        t[5],
        t[6],
        params,
        std::ptr::null_mut(),
    )
}
