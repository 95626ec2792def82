//! The oneDNN foundation layer against naive loops. Needs `ONEDNN_LIB_DIR` (the directory
//! holding `libdnnl.so.3`): with the `onednn` feature on, a missing library is a failure.

#![cfg(feature = "onednn")]

use std::sync::Arc;

use conv_runtime::onednn::{
    self, arg, Arg, Attr, DataType, Eltwise, Engine, FormatTag, Library, Memory, MemoryDesc,
    NormFlags, Primitive, PrimitiveDesc, Prop, Query, Stream,
};

fn lib() -> Library {
    match Library::load() {
        Ok(lib) => lib,
        Err(e) => panic!("{e}"),
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A memory's contents, in its physical order.
fn read(m: &Memory) -> Vec<f32> {
    m.to_vec().unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// A 2-D convolution's shape; activations NHWC, weights OHWI.
#[derive(Clone, Copy)]
struct Shape {
    n: usize,
    h: usize,
    w: usize,
    ic: usize,
    oc: usize,
    k: usize,
    stride: usize,
    pad_l: usize,
    pad_r: usize,
}

impl Shape {
    fn oh(&self) -> usize {
        (self.h + self.pad_l + self.pad_r - self.k) / self.stride + 1
    }
    fn ow(&self) -> usize {
        (self.w + self.pad_l + self.pad_r - self.k) / self.stride + 1
    }
    fn src_dims(&self) -> [i64; 4] {
        [self.n, self.ic, self.h, self.w].map(|d| d as i64)
    }
    fn dst_dims(&self) -> [i64; 4] {
        [self.n, self.oc, self.oh(), self.ow()].map(|d| d as i64)
    }
    fn weight_dims(&self) -> [i64; 4] {
        [self.oc, self.ic, self.k, self.k].map(|d| d as i64)
    }
    fn strides(&self) -> [i64; 2] {
        [self.stride as i64; 2]
    }
    fn pl(&self) -> [i64; 2] {
        [self.pad_l as i64; 2]
    }
    fn pr(&self) -> [i64; 2] {
        [self.pad_r as i64; 2]
    }
    fn src_len(&self) -> usize {
        self.n * self.h * self.w * self.ic
    }
    fn dst_len(&self) -> usize {
        self.n * self.oh() * self.ow() * self.oc
    }
    fn weight_len(&self) -> usize {
        self.oc * self.k * self.k * self.ic
    }

    /// Calls `f(n, oy, ox, o, ky, kx, i, src index, dst index, weight index)` for every
    /// multiply of the convolution that reads a real (unpadded) input.
    fn for_each_tap(&self, mut f: impl FnMut(usize, usize, usize)) {
        for n in 0..self.n {
            for oy in 0..self.oh() {
                for ox in 0..self.ow() {
                    for ky in 0..self.k {
                        for kx in 0..self.k {
                            let iy = (oy * self.stride + ky) as isize - self.pad_l as isize;
                            let ix = (ox * self.stride + kx) as isize - self.pad_l as isize;
                            if iy < 0 || ix < 0 || iy >= self.h as isize || ix >= self.w as isize {
                                continue;
                            }
                            let (iy, ix) = (iy as usize, ix as usize);
                            for o in 0..self.oc {
                                for i in 0..self.ic {
                                    let s = ((n * self.h + iy) * self.w + ix) * self.ic + i;
                                    let d = ((n * self.oh() + oy) * self.ow() + ox) * self.oc + o;
                                    let w = ((o * self.k + ky) * self.k + kx) * self.ic + i;
                                    f(s, d, w);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

const SHAPES: [Shape; 2] = [
    Shape {
        n: 1,
        h: 5,
        w: 5,
        ic: 2,
        oc: 3,
        k: 3,
        stride: 1,
        pad_l: 1,
        pad_r: 1,
    },
    Shape {
        n: 2,
        h: 7,
        w: 7,
        ic: 3,
        oc: 5,
        k: 3,
        stride: 2,
        pad_l: 1,
        pad_r: 0,
    },
];

/// Everything shared by one test's oneDNN calls.
struct Ctx {
    lib: Library,
    engine: Engine,
    stream: Stream,
}

impl Ctx {
    fn new() -> Self {
        let lib = lib();
        let engine = Engine::cpu(&lib).unwrap();
        let stream = Stream::new(&engine).unwrap();
        Self {
            lib,
            engine,
            stream,
        }
    }

    fn md(&self, dims: &[i64], tag: FormatTag) -> MemoryDesc {
        MemoryDesc::new(&self.lib, dims, DataType::F32, tag).unwrap()
    }

    /// Library-owned memory, zeroed.
    fn zeroed(&self, md: &MemoryDesc) -> Memory {
        Memory::allocate(&self.engine, md).unwrap()
    }

    /// Library-owned memory holding `data`.
    fn filled(&self, md: &MemoryDesc, data: &[f32]) -> Memory {
        let mut m = self.zeroed(md);
        m.write(data).unwrap();
        m
    }

    /// Creates `pd`'s primitive and executes it once on the context's stream.
    fn run(&self, pd: &PrimitiveDesc, args: &[(Arg, &Memory)]) {
        Primitive::new(pd)
            .unwrap()
            .execute(&self.stream, args)
            .unwrap();
        self.stream.wait().unwrap();
    }

    /// `from`'s contents in the layout `to`.
    fn reordered(&self, from: &Memory, to: &MemoryDesc) -> Memory {
        let out = self.zeroed(to);
        let pd = onednn::reorder(&self.engine, from.desc(), to).unwrap();
        self.run(&pd, &[(arg::FROM, from), (arg::TO, &out)]);
        out
    }

    fn forward_pd(&self, s: &Shape, attr: &Attr) -> PrimitiveDesc {
        onednn::conv_forward(
            &self.engine,
            Prop::ForwardTraining,
            &self.md(&s.src_dims(), FormatTag::NHWC),
            &self.md(&s.weight_dims(), FormatTag::ANY),
            Some(&self.md(&[s.oc as i64], FormatTag::X)),
            &self.md(&s.dst_dims(), FormatTag::NHWC),
            s.strides(),
            s.pl(),
            s.pr(),
            attr,
        )
        .unwrap()
    }
}

#[test]
fn version_is_3_2() {
    let lib = lib();
    let (major, minor, _) = lib.version();
    assert_eq!((major, minor), (3, 2), "{lib:?}");
    assert_eq!(onednn::version().unwrap(), lib.version());
}

#[test]
fn missing_library_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("onednn_missing_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = Library::load_from(&dir).unwrap_err();
    std::fs::remove_dir(&dir).unwrap();
    assert_eq!(err.operation, "oneDNN library load");
    let tried = dir.join("libdnnl.so.3");
    assert!(
        err.reason.contains(&*tried.to_string_lossy()),
        "names the file tried: {err}"
    );
    assert!(
        err.reason.contains("ONEDNN_LIB_DIR"),
        "names the variable: {err}"
    );
}

/// Set in the child process of `unset_variable_is_a_clear_error`.
const CHILD_VAR: &str = "ONEDNN_FFI_TEST_CHILD";

/// Runs only as that child, where `ONEDNN_LIB_DIR` was removed from the environment before the
/// process started (so no test races on the variable).
#[test]
#[ignore = "run by unset_variable_is_a_clear_error in a child process"]
fn unset_variable_child() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    let err = Library::load().unwrap_err();
    assert_eq!(err.operation, "oneDNN library load");
    assert!(err.reason.starts_with("ONEDNN_LIB_DIR is not set"), "{err}");
    assert!(err.reason.contains("libdnnl.so.3"), "{err}");
}

#[test]
fn unset_variable_is_a_clear_error() {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args(["--exact", "unset_variable_child", "--include-ignored"])
        .env_remove("ONEDNN_LIB_DIR")
        .env(CHILD_VAR, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn conv_forward_nhwc_bias_relu_matches_naive() {
    let cx = Ctx::new();
    for s in SHAPES {
        let x = values(s.src_len(), 1);
        let w = values(s.weight_len(), 2);
        let b = values(s.oc, 3);
        let mut want: Vec<f32> = (0..s.dst_len()).map(|d| b[d % s.oc]).collect();
        s.for_each_tap(|si, di, wi| want[di] += x[si] * w[wi]);
        want.iter_mut().for_each(|v| *v = v.max(0.0));

        let attr = Attr::with_eltwise(&cx.lib, Eltwise::Relu, 0.0, 0.0).unwrap();
        let pd = cx.forward_pd(&s, &attr);
        let user_w = cx.filled(&cx.md(&s.weight_dims(), FormatTag::OHWI), &w);
        let weights = cx.reordered(&user_w, &pd.query_md(Query::Weights).unwrap());
        let bias = cx.filled(&pd.exec_arg_md(arg::BIAS).unwrap(), &b);

        // The generated layers' path: unbound memories, the tensors' buffers lent per call.
        let mut x_buf = x.clone();
        let mut y_buf = vec![f32::NAN; s.dst_len()];
        let mut src = Memory::unbound(&cx.engine, &pd.query_md(Query::Src).unwrap()).unwrap();
        let mut dst = Memory::unbound(&cx.engine, &pd.query_md(Query::Dst).unwrap()).unwrap();
        // SAFETY: both buffers have exactly the descriptors' sizes and outlive the execution;
        // nothing else touches them until `unbind`.
        unsafe {
            src.set_data_handle(x_buf.as_mut_ptr().cast()).unwrap();
            dst.set_data_handle(y_buf.as_mut_ptr().cast()).unwrap();
        }
        cx.run(
            &pd,
            &[
                (arg::SRC, &src),
                (arg::WEIGHTS, &weights),
                (arg::BIAS, &bias),
                (arg::DST, &dst),
            ],
        );
        src.unbind().unwrap();
        dst.unbind().unwrap();
        assert_close("conv forward", &y_buf, &want);
        eprintln!("forward impl: {}", pd.impl_info().unwrap());
    }
}

#[test]
fn conv_backward_data_matches_naive() {
    let cx = Ctx::new();
    for s in SHAPES {
        let w = values(s.weight_len(), 4);
        let dy = values(s.dst_len(), 5);
        let mut want = vec![0.0f32; s.src_len()];
        s.for_each_tap(|si, di, wi| want[si] += dy[di] * w[wi]);

        let attr = Attr::new(&cx.lib).unwrap();
        let fwd = cx.forward_pd(&s, &attr);
        let pd = onednn::conv_backward_data(
            &cx.engine,
            &cx.md(&s.src_dims(), FormatTag::NHWC),
            &cx.md(&s.weight_dims(), FormatTag::ANY),
            &cx.md(&s.dst_dims(), FormatTag::NHWC),
            s.strides(),
            s.pl(),
            s.pr(),
            &fwd,
            &attr,
        )
        .unwrap();
        drop(fwd); // The backward descriptor keeps its hint alive.
        let user_w = cx.filled(&cx.md(&s.weight_dims(), FormatTag::OHWI), &w);
        let weights = cx.reordered(&user_w, &pd.query_md(Query::Weights).unwrap());
        let diff_dst = cx.filled(&pd.query_md(Query::DiffDst).unwrap(), &dy);
        let diff_src = cx.zeroed(&pd.query_md(Query::DiffSrc).unwrap());
        cx.run(
            &pd,
            &[
                (arg::DIFF_DST, &diff_dst),
                (arg::WEIGHTS, &weights),
                (arg::DIFF_SRC, &diff_src),
            ],
        );
        assert_close("conv backward data", &read(&diff_src), &want);
    }
}

#[test]
fn conv_backward_weights_matches_naive() {
    let cx = Ctx::new();
    for s in SHAPES {
        let x = values(s.src_len(), 6);
        let dy = values(s.dst_len(), 7);
        let mut want_w = vec![0.0f32; s.weight_len()];
        s.for_each_tap(|si, di, wi| want_w[wi] += dy[di] * x[si]);
        let mut want_b = vec![0.0f32; s.oc];
        for (d, v) in dy.iter().enumerate() {
            want_b[d % s.oc] += v;
        }

        let attr = Attr::new(&cx.lib).unwrap();
        let fwd = cx.forward_pd(&s, &attr);
        let pd = onednn::conv_backward_weights(
            &cx.engine,
            &cx.md(&s.src_dims(), FormatTag::NHWC),
            &cx.md(&s.weight_dims(), FormatTag::ANY),
            Some(&cx.md(&[s.oc as i64], FormatTag::X)),
            &cx.md(&s.dst_dims(), FormatTag::NHWC),
            s.strides(),
            s.pl(),
            s.pr(),
            &fwd,
            &attr,
        )
        .unwrap();
        let src = cx.filled(&pd.query_md(Query::Src).unwrap(), &x);
        let diff_dst = cx.filled(&pd.query_md(Query::DiffDst).unwrap(), &dy);
        let diff_w = cx.zeroed(&pd.query_md(Query::DiffWeights).unwrap());
        let diff_b = cx.zeroed(&pd.exec_arg_md(arg::DIFF_BIAS).unwrap());
        cx.run(
            &pd,
            &[
                (arg::SRC, &src),
                (arg::DIFF_DST, &diff_dst),
                (arg::DIFF_WEIGHTS, &diff_w),
                (arg::DIFF_BIAS, &diff_b),
            ],
        );
        let ohwi = cx.reordered(&diff_w, &cx.md(&s.weight_dims(), FormatTag::OHWI));
        assert_close("conv backward weights", &read(&ohwi), &want_w);
        assert_close("conv backward bias", &read(&diff_b), &want_b);
    }
}

#[test]
fn reorder_round_trip_and_transpose() {
    let cx = Ctx::new();
    let s = SHAPES[1];
    let w = values(s.weight_len(), 8);
    let ohwi = cx.filled(&cx.md(&s.weight_dims(), FormatTag::OHWI), &w);
    // Through the layout the convolution chose (blocked or not) and back.
    let attr = Attr::new(&cx.lib).unwrap();
    let chosen = cx.forward_pd(&s, &attr).query_md(Query::Weights).unwrap();
    let there = cx.reordered(&ohwi, &chosen);
    let back = cx.reordered(&there, ohwi.desc());
    assert_eq!(read(&back), w);
    // OHWI -> OIHW is a transpose of the last three axes.
    let oihw = read(&cx.reordered(&ohwi, &cx.md(&s.weight_dims(), FormatTag::OIHW)));
    for o in 0..s.oc {
        for i in 0..s.ic {
            for ky in 0..s.k {
                for kx in 0..s.k {
                    let a = oihw[((o * s.ic + i) * s.k + ky) * s.k + kx];
                    let b = w[((o * s.k + ky) * s.k + kx) * s.ic + i];
                    assert_eq!(a, b);
                }
            }
        }
    }
}

#[test]
fn memory_desc_queries_and_equality() {
    let cx = Ctx::new();
    let nhwc = cx.md(&[2, 3, 4, 5], FormatTag::NHWC);
    assert_eq!(nhwc.dims().unwrap(), vec![2, 3, 4, 5]);
    assert_eq!(nhwc.strides().unwrap(), vec![60, 1, 15, 3]);
    assert_eq!(nhwc.data_type().unwrap(), DataType::F32);
    assert_eq!(nhwc.size_bytes(), 2 * 3 * 4 * 5 * 4);
    assert_eq!(nhwc.inner_blocks().unwrap(), 0);
    let strided =
        MemoryDesc::with_strides(&cx.lib, &[2, 3, 4, 5], DataType::F32, &[60, 1, 15, 3]).unwrap();
    assert!(nhwc == strided);
    assert!(nhwc == nhwc.try_clone().unwrap());
    assert!(nhwc != cx.md(&[2, 3, 4, 5], FormatTag::NCHW));
    let any = cx.md(&[2, 3, 4, 5], FormatTag::ANY);
    assert!(
        Memory::allocate(&cx.engine, &any).is_err(),
        "ANY has no layout to allocate"
    );
}

#[test]
fn execute_refuses_wrong_arguments() {
    let cx = Ctx::new();
    let s = SHAPES[0];
    let attr = Attr::new(&cx.lib).unwrap();
    let pd = cx.forward_pd(&s, &attr);
    let prim = Primitive::new(&pd).unwrap();
    let alloc = |q: Query| cx.zeroed(&pd.query_md(q).unwrap());
    let (src, weights, dst) = (alloc(Query::Src), alloc(Query::Weights), alloc(Query::Dst));
    let bias = cx.zeroed(&pd.exec_arg_md(arg::BIAS).unwrap());
    let refused = |args: &[(Arg, &Memory)]| prim.execute(&cx.stream, args).unwrap_err();
    // Every argument the convolution takes, with `src` and `dst` as given.
    let all = |src, dst| {
        [
            (arg::SRC, src),
            (arg::WEIGHTS, &weights),
            (arg::BIAS, &bias),
            (arg::DST, dst),
        ]
    };

    let missing = refused(&[(arg::SRC, &src), (arg::WEIGHTS, &weights), (arg::DST, &dst)]);
    // oneDNN counts the arguments it uses and refuses a missing one.
    assert_eq!(missing.reason, "invalid_arguments (2)");
    assert!(
        missing.operation.contains("convolution forward"),
        "{missing}"
    );

    let swapped = refused(&all(&dst, &src));
    assert!(swapped.reason.contains("expects"), "{swapped}");

    let unbound = Memory::unbound(&cx.engine, src.desc()).unwrap();
    let err = refused(&all(&unbound, &dst));
    assert!(err.reason.contains("no buffer"), "{err}");

    let err = refused(&[&all(&src, &dst)[..], &[(arg::DIFF_DST, &dst)]].concat());
    assert!(err.reason.contains("not one this primitive takes"), "{err}");

    let elsewhere = Memory::allocate(&Engine::cpu(&cx.lib).unwrap(), src.desc()).unwrap();
    let err = refused(&all(&elsewhere, &dst));
    assert!(err.reason.contains("another engine"), "{err}");

    // A oneDNN status comes back as "<name> (<code>)".
    let err = onednn::conv_forward(
        &cx.engine,
        Prop::ForwardTraining,
        &cx.md(&s.src_dims(), FormatTag::NHWC),
        &cx.md(&[s.oc as i64, s.ic as i64 + 1, 3, 3], FormatTag::ANY),
        None,
        &cx.md(&s.dst_dims(), FormatTag::NHWC),
        s.strides(),
        s.pl(),
        s.pr(),
        &attr,
    )
    .unwrap_err();
    assert_eq!(
        err.operation,
        "oneDNN dnnl_convolution_forward_primitive_desc_create"
    );
    assert_eq!(err.reason, "invalid_arguments (2)");

    // Owned memory refuses a lent buffer.
    let mut owned = alloc(Query::Src);
    let mut buf = vec![0.0f32; s.src_len()];
    // SAFETY: refused before anything is bound.
    assert!(unsafe { owned.set_data_handle(buf.as_mut_ptr().cast()) }.is_err());
}

#[test]
fn batch_norm_training_forward_and_backward_match_naive() {
    let cx = Ctx::new();
    let (n, c, h, w) = (2usize, 3usize, 4usize, 5usize);
    let len = n * c * h * w;
    let m = (n * h * w) as f32;
    let eps = 1e-5f32;
    let x = values(len, 9);
    let gamma = values(c, 10);
    let beta = values(c, 11);
    let dy = values(len, 12);

    // Naive NHWC batch norm.
    let mut mean = vec![0.0f32; c];
    let mut var = vec![0.0f32; c];
    for (i, v) in x.iter().enumerate() {
        mean[i % c] += v / m;
    }
    for (i, v) in x.iter().enumerate() {
        var[i % c] += (v - mean[i % c]).powi(2) / m;
    }
    let inv: Vec<f32> = var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect();
    let xhat: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, v)| (v - mean[i % c]) * inv[i % c])
        .collect();
    let y: Vec<f32> = xhat
        .iter()
        .enumerate()
        .map(|(i, v)| gamma[i % c] * v + beta[i % c])
        .collect();
    let mut dgamma = vec![0.0f32; c];
    let mut dbeta = vec![0.0f32; c];
    for i in 0..len {
        dgamma[i % c] += dy[i] * xhat[i];
        dbeta[i % c] += dy[i];
    }
    let dx: Vec<f32> = (0..len)
        .map(|i| {
            let k = i % c;
            gamma[k] * inv[k] * (dy[i] - dbeta[k] / m - xhat[i] * dgamma[k] / m)
        })
        .collect();

    let dims = [n, c, h, w].map(|d| d as i64);
    let data = cx.md(&dims, FormatTag::NHWC);
    let flags = NormFlags::USE_SCALE | NormFlags::USE_SHIFT;
    let attr = Attr::new(&cx.lib).unwrap();
    let fwd = onednn::batch_norm_forward(
        &cx.engine,
        Prop::ForwardTraining,
        &data,
        &data,
        eps,
        flags,
        &attr,
    )
    .unwrap();
    let src = cx.filled(&data, &x);
    let dst = cx.zeroed(&data);
    let per_channel = |pd: &PrimitiveDesc, a| cx.zeroed(&pd.exec_arg_md(a).unwrap());
    let scale = cx.filled(&fwd.exec_arg_md(arg::SCALE).unwrap(), &gamma);
    let shift = cx.filled(&fwd.exec_arg_md(arg::SHIFT).unwrap(), &beta);
    let (mean_m, var_m) = (
        per_channel(&fwd, arg::MEAN),
        per_channel(&fwd, arg::VARIANCE),
    );
    cx.run(
        &fwd,
        &[
            (arg::SRC, &src),
            (arg::DST, &dst),
            (arg::SCALE, &scale),
            (arg::SHIFT, &shift),
            (arg::MEAN, &mean_m),
            (arg::VARIANCE, &var_m),
        ],
    );
    assert_close("bn y", &read(&dst), &y);
    assert_close("bn mean", &read(&mean_m), &mean);
    assert_close("bn variance", &read(&var_m), &var);

    let bwd = onednn::batch_norm_backward(
        &cx.engine,
        Prop::Backward,
        &data,
        &data,
        &data,
        eps,
        flags,
        &fwd,
        &attr,
    )
    .unwrap();
    let diff_dst = cx.filled(&data, &dy);
    let diff_src = cx.zeroed(&data);
    let diff_scale = per_channel(&bwd, arg::DIFF_SCALE);
    let diff_shift = per_channel(&bwd, arg::DIFF_SHIFT);
    cx.run(
        &bwd,
        &[
            (arg::SRC, &src),
            (arg::MEAN, &mean_m),
            (arg::VARIANCE, &var_m),
            (arg::DIFF_DST, &diff_dst),
            (arg::SCALE, &scale),
            (arg::DIFF_SRC, &diff_src),
            (arg::DIFF_SCALE, &diff_scale),
            (arg::DIFF_SHIFT, &diff_shift),
        ],
    );
    assert_close("bn dx", &read(&diff_src), &dx);
    assert_close("bn dgamma", &read(&diff_scale), &dgamma);
    assert_close("bn dbeta", &read(&diff_shift), &dbeta);
}

#[test]
fn eltwise_forward_and_backward() {
    let cx = Ctx::new();
    let x = values(24, 13);
    let dy = values(24, 14);
    let md = cx.md(&[2, 3, 2, 2], FormatTag::NHWC);
    let attr = Attr::new(&cx.lib).unwrap();
    let fwd = onednn::eltwise_forward(
        &cx.engine,
        Prop::ForwardTraining,
        Eltwise::Tanh,
        &md,
        &md,
        0.0,
        0.0,
        &attr,
    )
    .unwrap();
    let bwd = onednn::eltwise_backward(
        &cx.engine,
        Eltwise::Tanh,
        &md,
        &md,
        &md,
        0.0,
        0.0,
        &fwd,
        &attr,
    )
    .unwrap();
    let src = cx.filled(&md, &x);
    let dst = cx.zeroed(&md);
    cx.run(&fwd, &[(arg::SRC, &src), (arg::DST, &dst)]);
    let diff_dst = cx.filled(&md, &dy);
    let diff_src = cx.zeroed(&md);
    cx.run(
        &bwd,
        &[
            (arg::SRC, &src),
            (arg::DIFF_DST, &diff_dst),
            (arg::DIFF_SRC, &diff_src),
        ],
    );
    let y: Vec<f32> = x.iter().map(|v| v.tanh()).collect();
    let dx: Vec<f32> = x
        .iter()
        .zip(&dy)
        .map(|(v, d)| d * (1.0 - v.tanh().powi(2)))
        .collect();
    assert_close("tanh", &read(&dst), &y);
    assert_close("tanh backward", &read(&diff_src), &dx);
}

#[test]
fn thread_count_is_applied_on_the_executing_thread() {
    let cx = Ctx::new();
    let s = SHAPES[0];
    let attr = Attr::new(&cx.lib).unwrap();
    // 3: unlikely to be OpenMP's default (the core count), so the check means something.
    onednn::set_threads(3);
    let pd = cx.forward_pd(&s, &attr);
    // Applied on this thread by the descriptor's creation, and recorded in it.
    assert_eq!(cx.lib.omp_max_threads(), 3);
    assert_eq!(pd.threads(), 3);
    // Later changes leave existing descriptors and primitives alone.
    onednn::set_threads(1);
    // A fresh thread gets the descriptor's count when it executes.
    let prim = Primitive::new(&pd).unwrap();
    let lib = cx.lib.clone();
    let seen = std::thread::spawn(move || {
        // Untouched here: OpenMP's own default (the core count), not ours.
        let before = lib.omp_max_threads();
        let engine = pd.engine().clone();
        let mems: Vec<Memory> = prim
            .accepted_args()
            .iter()
            .map(|(_, md)| Memory::allocate(&engine, md).unwrap())
            .collect();
        let args: Vec<_> = prim
            .accepted_args()
            .iter()
            .map(|(a, _)| *a)
            .zip(&mems)
            .collect();
        // Streams (and memories) must be on the primitive's engine.
        let other = Stream::new(&Engine::cpu(&lib).unwrap()).unwrap();
        let err = prim.execute(&other, &args).unwrap_err();
        assert!(err.reason.contains("another engine"), "{err}");
        prim.execute(&Stream::new(&engine).unwrap(), &args).unwrap();
        (before, lib.omp_max_threads())
    })
    .join()
    .unwrap();
    assert_eq!(seen.1, 3, "applied by execute (was {})", seen.0);
    assert_eq!(onednn::threads(), 1);
}

#[test]
fn one_primitive_executes_from_several_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Library>();
    send_sync::<Engine>();
    send_sync::<MemoryDesc>();
    send_sync::<PrimitiveDesc>();
    send_sync::<Primitive>();
    send_sync::<Attr>();
    send::<Stream>();
    send::<Memory>();

    let cx = Ctx::new();
    let s = SHAPES[1];
    let attr = Attr::new(&cx.lib).unwrap();
    let pd = cx.forward_pd(&s, &attr);
    let prim = Arc::new(Primitive::new(&pd).unwrap());
    let w = values(s.weight_len(), 15);
    let mut want = vec![0.0f32; s.dst_len()];
    let x = values(s.src_len(), 16);
    s.for_each_tap(|si, di, wi| want[di] += x[si] * w[wi]);
    let user_w = cx.filled(&cx.md(&s.weight_dims(), FormatTag::OHWI), &w);
    let weights_data = read(&cx.reordered(&user_w, &pd.query_md(Query::Weights).unwrap()));
    let handles: Vec<_> = (0..3)
        .map(|_| {
            let (prim, pd, engine) = (prim.clone(), pd.clone(), cx.engine.clone());
            let (x, weights_data, want) = (x.clone(), weights_data.clone(), want.clone());
            std::thread::spawn(move || {
                let stream = Stream::new(&engine).unwrap();
                let mem = |q: Query, data: Option<&[f32]>| {
                    let mut m = Memory::allocate(&engine, &pd.query_md(q).unwrap()).unwrap();
                    if let Some(d) = data {
                        m.write(d).unwrap();
                    }
                    m
                };
                let src = mem(Query::Src, Some(&x));
                let weights = mem(Query::Weights, Some(&weights_data));
                let bias = Memory::allocate(&engine, &pd.exec_arg_md(arg::BIAS).unwrap()).unwrap();
                let dst = mem(Query::Dst, None);
                for _ in 0..20 {
                    prim.execute(
                        &stream,
                        &[
                            (arg::SRC, &src),
                            (arg::WEIGHTS, &weights),
                            (arg::BIAS, &bias),
                            (arg::DST, &dst),
                        ],
                    )
                    .unwrap();
                }
                assert_close("threaded conv", &read(&dst), &want);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}
