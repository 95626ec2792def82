//! Raw bindings to the oneDNN v3 C API, loaded at run time.
//!
//! Checked against oneDNN 3.2.0 (`DNNL_VERSION_HASH` 40112196287e8866a7259df35f817229454d0c96),
//! as installed by `pip install onednn-devel-cpu-gomp==2023.2.0`, headers:
//! `include/oneapi/dnnl/dnnl_common_types.h` (status, data types, engine/stream kinds, version
//! struct), `dnnl_types.h` (format tags, prop/alg kinds, normalization flags, queries,
//! `DNNL_ARG_*`, scratchpad mode, exec-arg struct), `dnnl_common.h` (engine, stream, version
//! functions) and `dnnl.h` (every other function). `check_ffi.py` next to this file re-checks
//! mechanically every constant's value, every struct's layout and every function pointer's C type
//! against those headers: `python3 check_ffi.py <include dir>`.
//!
//! Names are the C names, so each item can be found in the headers by its name. C enums are
//! `int`-sized; the enums used here have no negative values, so GCC and Clang give them type
//! `unsigned int` (`c_uint` here), which the checker confirms by size.
//!
//! Every function returns a status except where noted (`dnnl_memory_desc_equal`,
//! `dnnl_memory_desc_get_size`, `dnnl_primitive_desc_query_md`, `dnnl_version`, the OpenMP
//! calls).

#![allow(non_camel_case_types, non_upper_case_globals, dead_code)]

use std::os::raw::{c_char, c_float, c_int, c_uint, c_void};

// ---------------------------------------------------------------------------------------------
// Opaque handles.

/// Declares an opaque C struct that Rust only ever holds by pointer.
macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
                // Not Send, Sync or Unpin by itself: the safe layer decides.
                _marker: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
            }
        )*
    };
}

opaque!(
    dnnl_engine,
    dnnl_stream,
    dnnl_memory_desc,
    dnnl_memory,
    dnnl_primitive_desc,
    dnnl_primitive_attr,
    dnnl_post_ops,
    dnnl_primitive,
);

pub type dnnl_engine_t = *mut dnnl_engine;
pub type dnnl_stream_t = *mut dnnl_stream;
pub type dnnl_memory_desc_t = *mut dnnl_memory_desc;
pub type const_dnnl_memory_desc_t = *const dnnl_memory_desc;
pub type dnnl_memory_t = *mut dnnl_memory;
pub type const_dnnl_memory_t = *const dnnl_memory;
pub type dnnl_primitive_desc_t = *mut dnnl_primitive_desc;
pub type const_dnnl_primitive_desc_t = *const dnnl_primitive_desc;
pub type dnnl_primitive_attr_t = *mut dnnl_primitive_attr;
pub type const_dnnl_primitive_attr_t = *const dnnl_primitive_attr;
pub type dnnl_post_ops_t = *mut dnnl_post_ops;
pub type const_dnnl_post_ops_t = *const dnnl_post_ops;
pub type dnnl_primitive_t = *mut dnnl_primitive;
pub type const_dnnl_primitive_t = *const dnnl_primitive;

// ---------------------------------------------------------------------------------------------
// dnnl_common_types.h

pub type dnnl_status_t = c_uint;
pub const dnnl_success: dnnl_status_t = 0;
pub const dnnl_out_of_memory: dnnl_status_t = 1;
pub const dnnl_invalid_arguments: dnnl_status_t = 2;
pub const dnnl_unimplemented: dnnl_status_t = 3;
pub const dnnl_last_impl_reached: dnnl_status_t = 4;
pub const dnnl_runtime_error: dnnl_status_t = 5;
pub const dnnl_not_required: dnnl_status_t = 6;
pub const dnnl_invalid_graph: dnnl_status_t = 7;
pub const dnnl_invalid_graph_op: dnnl_status_t = 8;
pub const dnnl_invalid_shape: dnnl_status_t = 9;
pub const dnnl_invalid_data_type: dnnl_status_t = 10;

pub type dnnl_data_type_t = c_uint;
pub const dnnl_data_type_undef: dnnl_data_type_t = 0;
pub const dnnl_f16: dnnl_data_type_t = 1;
pub const dnnl_bf16: dnnl_data_type_t = 2;
pub const dnnl_f32: dnnl_data_type_t = 3;
pub const dnnl_s32: dnnl_data_type_t = 4;
pub const dnnl_s8: dnnl_data_type_t = 5;
pub const dnnl_u8: dnnl_data_type_t = 6;
pub const dnnl_f64: dnnl_data_type_t = 7;

pub const DNNL_MAX_NDIMS: usize = 12;
pub type dnnl_dim_t = i64;
/// Decays to `*const dnnl_dim_t` as a function parameter, as in C.
pub type dnnl_dims_t = [dnnl_dim_t; DNNL_MAX_NDIMS];

pub type dnnl_engine_kind_t = c_uint;
pub const dnnl_any_engine: dnnl_engine_kind_t = 0;
pub const dnnl_cpu: dnnl_engine_kind_t = 1;
pub const dnnl_gpu: dnnl_engine_kind_t = 2;

/// `dnnl_stream_flags_t`; passed to `dnnl_stream_create` as `unsigned`.
pub type dnnl_stream_flags_t = c_uint;
pub const dnnl_stream_in_order: dnnl_stream_flags_t = 0x1;
pub const dnnl_stream_out_of_order: dnnl_stream_flags_t = 0x2;
pub const dnnl_stream_default_flags: dnnl_stream_flags_t = dnnl_stream_in_order;

#[repr(C)]
pub struct dnnl_version_t {
    pub major: c_int,
    pub minor: c_int,
    pub patch: c_int,
    pub hash: *const c_char,
    pub cpu_runtime: c_uint,
    pub gpu_runtime: c_uint,
}

/// `dnnl_version_t::cpu_runtime` of an OpenMP build (`dnnl_config.h`).
pub const DNNL_RUNTIME_OMP: c_uint = 2;

// ---------------------------------------------------------------------------------------------
// dnnl_types.h

pub type dnnl_format_kind_t = c_uint;
pub const dnnl_format_kind_undef: dnnl_format_kind_t = 0;
pub const dnnl_format_kind_any: dnnl_format_kind_t = 1;
pub const dnnl_blocked: dnnl_format_kind_t = 2;
pub const dnnl_format_kind_opaque: dnnl_format_kind_t = 3;

/// Only the plain tags; the many blocked tags are chosen by the library through `any`.
pub type dnnl_format_tag_t = c_uint;
pub const dnnl_format_tag_undef: dnnl_format_tag_t = 0;
pub const dnnl_format_tag_any: dnnl_format_tag_t = 1;
pub const dnnl_a: dnnl_format_tag_t = 2;
pub const dnnl_ab: dnnl_format_tag_t = 3;
pub const dnnl_abc: dnnl_format_tag_t = 4;
pub const dnnl_abcd: dnnl_format_tag_t = 5;
pub const dnnl_abcde: dnnl_format_tag_t = 6;
pub const dnnl_ba: dnnl_format_tag_t = 14;
pub const dnnl_acb: dnnl_format_tag_t = 15;
pub const dnnl_acdb: dnnl_format_tag_t = 22;
pub const dnnl_bacd: dnnl_format_tag_t = 25;
pub const dnnl_bcda: dnnl_format_tag_t = 26;
pub const dnnl_cdab: dnnl_format_tag_t = 27;
pub const dnnl_cdba: dnnl_format_tag_t = 28;
// Semantic aliases (same values as the plain tags above).
pub const dnnl_x: dnnl_format_tag_t = dnnl_a;
pub const dnnl_nc: dnnl_format_tag_t = dnnl_ab;
pub const dnnl_cn: dnnl_format_tag_t = dnnl_ba;
pub const dnnl_ncw: dnnl_format_tag_t = dnnl_abc;
pub const dnnl_nwc: dnnl_format_tag_t = dnnl_acb;
pub const dnnl_nchw: dnnl_format_tag_t = dnnl_abcd;
pub const dnnl_nhwc: dnnl_format_tag_t = dnnl_acdb;
pub const dnnl_chwn: dnnl_format_tag_t = dnnl_bcda;
pub const dnnl_oi: dnnl_format_tag_t = dnnl_ab;
pub const dnnl_io: dnnl_format_tag_t = dnnl_ba;
pub const dnnl_oihw: dnnl_format_tag_t = dnnl_abcd;
pub const dnnl_ohwi: dnnl_format_tag_t = dnnl_acdb;
pub const dnnl_hwio: dnnl_format_tag_t = dnnl_cdba;
pub const dnnl_ihwo: dnnl_format_tag_t = dnnl_bcda;
pub const dnnl_iohw: dnnl_format_tag_t = dnnl_bacd;

pub type dnnl_prop_kind_t = c_uint;
pub const dnnl_prop_kind_undef: dnnl_prop_kind_t = 0;
pub const dnnl_forward_training: dnnl_prop_kind_t = 64;
pub const dnnl_forward_inference: dnnl_prop_kind_t = 96;
pub const dnnl_forward: dnnl_prop_kind_t = dnnl_forward_training;
pub const dnnl_backward: dnnl_prop_kind_t = 128;
pub const dnnl_backward_data: dnnl_prop_kind_t = 160;
pub const dnnl_backward_weights: dnnl_prop_kind_t = 192;
pub const dnnl_backward_bias: dnnl_prop_kind_t = 193;

pub type dnnl_primitive_kind_t = c_uint;
pub const dnnl_reorder: dnnl_primitive_kind_t = 1;
pub const dnnl_convolution: dnnl_primitive_kind_t = 5;
pub const dnnl_eltwise: dnnl_primitive_kind_t = 7;
pub const dnnl_batch_normalization: dnnl_primitive_kind_t = 9;

pub type dnnl_alg_kind_t = c_uint;
pub const dnnl_alg_kind_undef: dnnl_alg_kind_t = 0;
pub const dnnl_convolution_direct: dnnl_alg_kind_t = 0x1;
pub const dnnl_convolution_winograd: dnnl_alg_kind_t = 0x2;
pub const dnnl_convolution_auto: dnnl_alg_kind_t = 0x3;
pub const dnnl_eltwise_relu: dnnl_alg_kind_t = 0x20;
pub const dnnl_eltwise_tanh: dnnl_alg_kind_t = 0x21;
pub const dnnl_eltwise_elu: dnnl_alg_kind_t = 0x22;
pub const dnnl_eltwise_square: dnnl_alg_kind_t = 0x23;
pub const dnnl_eltwise_abs: dnnl_alg_kind_t = 0x24;
pub const dnnl_eltwise_sqrt: dnnl_alg_kind_t = 0x25;
pub const dnnl_eltwise_linear: dnnl_alg_kind_t = 0x26;
pub const dnnl_eltwise_soft_relu: dnnl_alg_kind_t = 0x27;
pub const dnnl_eltwise_hardsigmoid: dnnl_alg_kind_t = 0x28;
pub const dnnl_eltwise_logistic: dnnl_alg_kind_t = 0x29;
pub const dnnl_eltwise_exp: dnnl_alg_kind_t = 0x2a;
pub const dnnl_eltwise_gelu_tanh: dnnl_alg_kind_t = 0x2b;
pub const dnnl_eltwise_swish: dnnl_alg_kind_t = 0x2c;
pub const dnnl_eltwise_log: dnnl_alg_kind_t = 0x2d;
pub const dnnl_eltwise_clip: dnnl_alg_kind_t = 0x2e;
pub const dnnl_eltwise_clip_v2: dnnl_alg_kind_t = 0x2f;
pub const dnnl_eltwise_pow: dnnl_alg_kind_t = 0x30;
pub const dnnl_eltwise_gelu_erf: dnnl_alg_kind_t = 0x31;
pub const dnnl_eltwise_round: dnnl_alg_kind_t = 0x32;
pub const dnnl_eltwise_mish: dnnl_alg_kind_t = 0x33;
pub const dnnl_eltwise_hardswish: dnnl_alg_kind_t = 0x34;
pub const dnnl_eltwise_relu_use_dst_for_bwd: dnnl_alg_kind_t = 0x100;
pub const dnnl_eltwise_tanh_use_dst_for_bwd: dnnl_alg_kind_t = 0x101;
pub const dnnl_eltwise_elu_use_dst_for_bwd: dnnl_alg_kind_t = 0x102;
pub const dnnl_eltwise_sqrt_use_dst_for_bwd: dnnl_alg_kind_t = 0x103;
pub const dnnl_eltwise_logistic_use_dst_for_bwd: dnnl_alg_kind_t = 0x104;
pub const dnnl_eltwise_exp_use_dst_for_bwd: dnnl_alg_kind_t = 0x105;
pub const dnnl_eltwise_clip_v2_use_dst_for_bwd: dnnl_alg_kind_t = 0x106;
pub const dnnl_pooling_max: dnnl_alg_kind_t = 0x1ff;
pub const dnnl_pooling_avg_include_padding: dnnl_alg_kind_t = 0x2ff;
pub const dnnl_pooling_avg_exclude_padding: dnnl_alg_kind_t = 0x3ff;

/// `dnnl_normalization_flags_t`; passed to the batch-normalization functions as `unsigned`.
pub type dnnl_normalization_flags_t = c_uint;
pub const dnnl_normalization_flags_none: dnnl_normalization_flags_t = 0x0;
pub const dnnl_use_global_stats: dnnl_normalization_flags_t = 0x1;
pub const dnnl_use_scale: dnnl_normalization_flags_t = 0x2;
pub const dnnl_use_shift: dnnl_normalization_flags_t = 0x4;
pub const dnnl_fuse_norm_relu: dnnl_normalization_flags_t = 0x8;
pub const dnnl_fuse_norm_add_relu: dnnl_normalization_flags_t = 0x10;

/// `dnnl_memory_create` handle: no buffer yet (set one with `dnnl_memory_set_data_handle`).
pub const DNNL_MEMORY_NONE: *mut c_void = std::ptr::null_mut();
/// `dnnl_memory_create` handle: the library allocates and owns the buffer.
pub const DNNL_MEMORY_ALLOCATE: *mut c_void = usize::MAX as *mut c_void;

pub type dnnl_scratchpad_mode_t = c_uint;
pub const dnnl_scratchpad_mode_library: dnnl_scratchpad_mode_t = 0;
pub const dnnl_scratchpad_mode_user: dnnl_scratchpad_mode_t = 1;

pub const DNNL_ARG_SRC_0: c_int = 1;
pub const DNNL_ARG_SRC: c_int = DNNL_ARG_SRC_0;
pub const DNNL_ARG_FROM: c_int = DNNL_ARG_SRC_0;
pub const DNNL_ARG_SRC_1: c_int = 2;
pub const DNNL_ARG_DST_0: c_int = 17;
pub const DNNL_ARG_DST: c_int = DNNL_ARG_DST_0;
pub const DNNL_ARG_TO: c_int = DNNL_ARG_DST_0;
pub const DNNL_ARG_WEIGHTS_0: c_int = 33;
pub const DNNL_ARG_WEIGHTS: c_int = DNNL_ARG_WEIGHTS_0;
pub const DNNL_ARG_BIAS: c_int = 41;
pub const DNNL_ARG_MEAN: c_int = 49;
pub const DNNL_ARG_VARIANCE: c_int = 50;
pub const DNNL_ARG_SCALE: c_int = 51;
pub const DNNL_ARG_SHIFT: c_int = 52;
pub const DNNL_ARG_WORKSPACE: c_int = 64;
pub const DNNL_ARG_SCRATCHPAD: c_int = 80;
pub const DNNL_ARG_DIFF_SRC_0: c_int = 129;
pub const DNNL_ARG_DIFF_SRC: c_int = DNNL_ARG_DIFF_SRC_0;
pub const DNNL_ARG_DIFF_SRC_1: c_int = 130;
pub const DNNL_ARG_DIFF_DST_0: c_int = 145;
pub const DNNL_ARG_DIFF_DST: c_int = DNNL_ARG_DIFF_DST_0;
pub const DNNL_ARG_DIFF_WEIGHTS_0: c_int = 161;
pub const DNNL_ARG_DIFF_WEIGHTS: c_int = DNNL_ARG_DIFF_WEIGHTS_0;
pub const DNNL_ARG_DIFF_BIAS: c_int = 169;
pub const DNNL_ARG_DIFF_SCALE: c_int = 255;
pub const DNNL_ARG_DIFF_SHIFT: c_int = 256;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct dnnl_exec_arg_t {
    pub arg: c_int,
    pub memory: dnnl_memory_t,
}

pub type dnnl_query_t = c_uint;
pub const dnnl_query_undef: dnnl_query_t = 0;
pub const dnnl_query_engine: dnnl_query_t = 1;
pub const dnnl_query_primitive_kind: dnnl_query_t = 2;
pub const dnnl_query_num_of_inputs_s32: dnnl_query_t = 3;
pub const dnnl_query_num_of_outputs_s32: dnnl_query_t = 4;
pub const dnnl_query_time_estimate_f64: dnnl_query_t = 5;
pub const dnnl_query_memory_consumption_s64: dnnl_query_t = 6;
pub const dnnl_query_scratchpad_engine: dnnl_query_t = 7;
pub const dnnl_query_impl_info_str: dnnl_query_t = 8;
pub const dnnl_query_prop_kind: dnnl_query_t = 11;
pub const dnnl_query_strides: dnnl_query_t = 14;
pub const dnnl_query_some_md: dnnl_query_t = 128;
pub const dnnl_query_src_md: dnnl_query_t = 129;
pub const dnnl_query_diff_src_md: dnnl_query_t = 130;
pub const dnnl_query_weights_md: dnnl_query_t = 131;
pub const dnnl_query_diff_weights_md: dnnl_query_t = 132;
pub const dnnl_query_dst_md: dnnl_query_t = 133;
pub const dnnl_query_diff_dst_md: dnnl_query_t = 134;
pub const dnnl_query_workspace_md: dnnl_query_t = 135;
pub const dnnl_query_scratchpad_md: dnnl_query_t = 136;
pub const dnnl_query_exec_arg_md: dnnl_query_t = 255;
pub const dnnl_query_ndims_s32: dnnl_query_t = 256;
pub const dnnl_query_dims: dnnl_query_t = 257;
pub const dnnl_query_data_type: dnnl_query_t = 258;
pub const dnnl_query_submemory_offset_s64: dnnl_query_t = 259;
pub const dnnl_query_padded_dims: dnnl_query_t = 260;
pub const dnnl_query_padded_offsets: dnnl_query_t = 261;
pub const dnnl_query_format_kind: dnnl_query_t = 262;
pub const dnnl_query_inner_nblks_s32: dnnl_query_t = 263;
pub const dnnl_query_inner_blks: dnnl_query_t = 264;
pub const dnnl_query_inner_idxs: dnnl_query_t = 265;

// ---------------------------------------------------------------------------------------------
// Function table.

/// Declares [`Api`], one function pointer per entry, and its loader. Each entry is
/// `c_name(params) -> return;`, the C prototype transliterated (the checker reads these lines).
macro_rules! api {
    ($( $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $(-> $ret:ty)? ; )*) => {
        /// The oneDNN functions the safe layer calls, resolved from `libdnnl.so.3`.
        pub struct Api {
            $( pub $name: unsafe extern "C" fn($($arg: $ty),*) $(-> $ret)?, )*
        }

        impl Api {
            /// Resolves every entry.
            ///
            /// # Safety
            /// `lib` must be oneDNN 3.x, whose exported functions have the C types above, and
            /// must stay loaded while the table is used.
            pub unsafe fn load(lib: &libloading::Library) -> Result<Self, (&'static str, libloading::Error)> {
                Ok(Self {
                    $( $name: *lib
                        .get::<unsafe extern "C" fn($($ty),*) $(-> $ret)?>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                        .map_err(|e| (stringify!($name), e))?, )*
                })
            }
        }
    };
}

api! {
    // dnnl_common.h
    dnnl_version() -> *const dnnl_version_t;
    dnnl_engine_create(engine: *mut dnnl_engine_t, kind: dnnl_engine_kind_t, index: usize) -> dnnl_status_t;
    dnnl_engine_destroy(engine: dnnl_engine_t) -> dnnl_status_t;
    dnnl_stream_create(stream: *mut dnnl_stream_t, engine: dnnl_engine_t, flags: c_uint) -> dnnl_status_t;
    dnnl_stream_wait(stream: dnnl_stream_t) -> dnnl_status_t;
    dnnl_stream_destroy(stream: dnnl_stream_t) -> dnnl_status_t;

    // dnnl.h: memory descriptors
    dnnl_memory_desc_create_with_tag(memory_desc: *mut dnnl_memory_desc_t, ndims: c_int, dims: *const dnnl_dim_t, data_type: dnnl_data_type_t, tag: dnnl_format_tag_t) -> dnnl_status_t;
    dnnl_memory_desc_create_with_strides(memory_desc: *mut dnnl_memory_desc_t, ndims: c_int, dims: *const dnnl_dim_t, data_type: dnnl_data_type_t, strides: *const dnnl_dim_t) -> dnnl_status_t;
    dnnl_memory_desc_clone(memory_desc: *mut dnnl_memory_desc_t, existing_memory_desc: const_dnnl_memory_desc_t) -> dnnl_status_t;
    dnnl_memory_desc_destroy(memory_desc: dnnl_memory_desc_t) -> dnnl_status_t;
    dnnl_memory_desc_query(memory_desc: const_dnnl_memory_desc_t, what: dnnl_query_t, result: *mut c_void) -> dnnl_status_t;
    dnnl_memory_desc_equal(lhs: const_dnnl_memory_desc_t, rhs: const_dnnl_memory_desc_t) -> c_int;
    dnnl_memory_desc_get_size(memory_desc: const_dnnl_memory_desc_t) -> usize;

    // dnnl.h: memory objects
    dnnl_memory_create(memory: *mut dnnl_memory_t, memory_desc: const_dnnl_memory_desc_t, engine: dnnl_engine_t, handle: *mut c_void) -> dnnl_status_t;
    dnnl_memory_get_data_handle(memory: const_dnnl_memory_t, handle: *mut *mut c_void) -> dnnl_status_t;
    dnnl_memory_set_data_handle(memory: dnnl_memory_t, handle: *mut c_void) -> dnnl_status_t;
    dnnl_memory_destroy(memory: dnnl_memory_t) -> dnnl_status_t;

    // dnnl.h: attributes and post-ops
    dnnl_primitive_attr_create(attr: *mut dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_primitive_attr_destroy(attr: dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_primitive_attr_set_scratchpad_mode(attr: dnnl_primitive_attr_t, mode: dnnl_scratchpad_mode_t) -> dnnl_status_t;
    dnnl_primitive_attr_set_post_ops(attr: dnnl_primitive_attr_t, post_ops: const_dnnl_post_ops_t) -> dnnl_status_t;
    dnnl_post_ops_create(post_ops: *mut dnnl_post_ops_t) -> dnnl_status_t;
    dnnl_post_ops_append_eltwise(post_ops: dnnl_post_ops_t, alg_kind: dnnl_alg_kind_t, alpha: c_float, beta: c_float) -> dnnl_status_t;
    dnnl_post_ops_destroy(post_ops: dnnl_post_ops_t) -> dnnl_status_t;

    // dnnl.h: primitive descriptors
    dnnl_convolution_forward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, alg_kind: dnnl_alg_kind_t, src_desc: const_dnnl_memory_desc_t, weights_desc: const_dnnl_memory_desc_t, bias_desc: const_dnnl_memory_desc_t, dst_desc: const_dnnl_memory_desc_t, strides: *const dnnl_dim_t, dilates: *const dnnl_dim_t, padding_l: *const dnnl_dim_t, padding_r: *const dnnl_dim_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_convolution_backward_data_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, alg_kind: dnnl_alg_kind_t, diff_src_desc: const_dnnl_memory_desc_t, weights_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, strides: *const dnnl_dim_t, dilates: *const dnnl_dim_t, padding_l: *const dnnl_dim_t, padding_r: *const dnnl_dim_t, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_convolution_backward_weights_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, alg_kind: dnnl_alg_kind_t, src_desc: const_dnnl_memory_desc_t, diff_weights_desc: const_dnnl_memory_desc_t, diff_bias_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, strides: *const dnnl_dim_t, dilates: *const dnnl_dim_t, padding_l: *const dnnl_dim_t, padding_r: *const dnnl_dim_t, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_batch_normalization_forward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, src_desc: const_dnnl_memory_desc_t, dst_desc: const_dnnl_memory_desc_t, epsilon: c_float, flags: c_uint, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_batch_normalization_backward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, diff_src_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, src_desc: const_dnnl_memory_desc_t, epsilon: c_float, flags: c_uint, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_eltwise_forward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, alg_kind: dnnl_alg_kind_t, src_desc: const_dnnl_memory_desc_t, dst_desc: const_dnnl_memory_desc_t, alpha: c_float, beta: c_float, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_eltwise_backward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, alg_kind: dnnl_alg_kind_t, diff_src_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, data_desc: const_dnnl_memory_desc_t, alpha: c_float, beta: c_float, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_pooling_forward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, alg_kind: dnnl_alg_kind_t, src_desc: const_dnnl_memory_desc_t, dst_desc: const_dnnl_memory_desc_t, strides: *const dnnl_dim_t, kernel: *const dnnl_dim_t, dilation: *const dnnl_dim_t, padding_l: *const dnnl_dim_t, padding_r: *const dnnl_dim_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_pooling_backward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, alg_kind: dnnl_alg_kind_t, diff_src_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, strides: *const dnnl_dim_t, kernel: *const dnnl_dim_t, dilation: *const dnnl_dim_t, padding_l: *const dnnl_dim_t, padding_r: *const dnnl_dim_t, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_inner_product_forward_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, prop_kind: dnnl_prop_kind_t, src_desc: const_dnnl_memory_desc_t, weights_desc: const_dnnl_memory_desc_t, bias_desc: const_dnnl_memory_desc_t, dst_desc: const_dnnl_memory_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_inner_product_backward_data_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, diff_src_desc: const_dnnl_memory_desc_t, weights_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_inner_product_backward_weights_primitive_desc_create(primitive_desc: *mut dnnl_primitive_desc_t, engine: dnnl_engine_t, src_desc: const_dnnl_memory_desc_t, diff_weights_desc: const_dnnl_memory_desc_t, diff_bias_desc: const_dnnl_memory_desc_t, diff_dst_desc: const_dnnl_memory_desc_t, hint_fwd_pd: const_dnnl_primitive_desc_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_reorder_primitive_desc_create(reorder_primitive_desc: *mut dnnl_primitive_desc_t, src_desc: const_dnnl_memory_desc_t, src_engine: dnnl_engine_t, dst_desc: const_dnnl_memory_desc_t, dst_engine: dnnl_engine_t, attr: const_dnnl_primitive_attr_t) -> dnnl_status_t;
    dnnl_primitive_desc_query(primitive_desc: const_dnnl_primitive_desc_t, what: dnnl_query_t, index: c_int, result: *mut c_void) -> dnnl_status_t;
    dnnl_primitive_desc_query_md(primitive_desc: const_dnnl_primitive_desc_t, what: dnnl_query_t, index: c_int) -> const_dnnl_memory_desc_t;
    dnnl_primitive_desc_destroy(primitive_desc: dnnl_primitive_desc_t) -> dnnl_status_t;

    // dnnl.h: primitives
    dnnl_primitive_create(primitive: *mut dnnl_primitive_t, primitive_desc: const_dnnl_primitive_desc_t) -> dnnl_status_t;
    dnnl_primitive_execute(primitive: const_dnnl_primitive_t, stream: dnnl_stream_t, nargs: c_int, args: *const dnnl_exec_arg_t) -> dnnl_status_t;
    dnnl_primitive_destroy(primitive: dnnl_primitive_t) -> dnnl_status_t;
}

/// The OpenMP calls, resolved from `libgomp.so.1` (the runtime this oneDNN build uses).
pub struct OmpApi {
    /// `void omp_set_num_threads(int)`: sets the calling thread's `nthreads-var`.
    pub omp_set_num_threads: unsafe extern "C" fn(num_threads: c_int),
    /// `int omp_get_max_threads(void)`: the calling thread's `nthreads-var`.
    pub omp_get_max_threads: unsafe extern "C" fn() -> c_int,
}

impl OmpApi {
    /// Resolves both entries.
    ///
    /// # Safety
    /// `lib` must be an OpenMP runtime and must stay loaded while the table is used.
    pub unsafe fn load(
        lib: &libloading::Library,
    ) -> Result<Self, (&'static str, libloading::Error)> {
        Ok(Self {
            omp_set_num_threads: *lib
                .get::<unsafe extern "C" fn(c_int)>(b"omp_set_num_threads\0")
                .map_err(|e| ("omp_set_num_threads", e))?,
            omp_get_max_threads: *lib
                .get::<unsafe extern "C" fn() -> c_int>(b"omp_get_max_threads\0")
                .map_err(|e| ("omp_get_max_threads", e))?,
        })
    }
}
