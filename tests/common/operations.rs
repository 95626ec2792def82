//! Every operation of a generated layer once, with every result kept: for the suites that
//! compare two runs of the same layer bit for bit (tests/threads.rs, tests/hygiene.rs).

/// `every_operation!(Layer, LayerGrads, LayerState, device)`: a layer from seed 11, evaluate at
/// batch 1 and at the training batch, forward and the three backward passes in both modes, and
/// the running statistics at the end, on `device`. Returns `(what, values as f64)` per result.
/// Hygienic (absolute paths, `__` names): tests/hygiene.rs runs it among hostile items.
macro_rules! every_operation {
    ($l:ident, $grads:ident, $state:ident, $device:expr) => {{
        type __T = <$l as ::conv_runtime::Parameters>::Elem;
        type __X<const __N: usize> = ::conv_runtime::Tensor<
            __T,
            { __N },
            { $l::INPUT_HEIGHT },
            { $l::INPUT_WIDTH },
            { $l::INPUT_CHANNELS },
        >;
        type __Y<const __N: usize> = ::conv_runtime::Tensor<
            __T,
            { __N },
            { $l::OUTPUT_HEIGHT },
            { $l::OUTPUT_WIDTH },
            { $l::OUTPUT_CHANNELS },
        >;
        fn __values<__E: ::conv_runtime::Element>(v: &[__E]) -> ::std::vec::Vec<f64> {
            v.iter()
                .map(|x| <__E as ::conv_runtime::Element>::to_f64(*x))
                .collect()
        }
        let value = |i: usize| {
            <__T as ::conv_runtime::Element>::from_f64(((i * 7919) % 101) as f64 / 50.0 - 1.0)
        };
        let mut device = $device;
        let mut layer = $l::new(&mut ::conv_runtime::Rng::seed_from_u64(11));
        let mut results: ::std::vec::Vec<(&str, ::std::vec::Vec<f64>)> = ::std::vec::Vec::new();
        let x1 = __X::<1>::from_fn(value);
        let mut y1 = __Y::<1>::zeros();
        layer.evaluate(&mut device, &x1, &mut y1).expect("evaluate");
        results.push(("evaluate, batch 1", __values(y1.as_slice())));
        let x = __X::<{ $l::BATCH_SIZE }>::from_fn(value);
        let mut y = __Y::<{ $l::BATCH_SIZE }>::zeros();
        layer.evaluate(&mut device, &x, &mut y).expect("evaluate");
        results.push(("evaluate", __values(y.as_slice())));
        let d_output = __Y::<{ $l::BATCH_SIZE }>::from_fn(|i| value(i + 5));
        for mode in [::conv_runtime::Mode::Train, ::conv_runtime::Mode::Eval] {
            let mut state = $state::new();
            layer
                .forward(&mut device, &x, &mut state, mode)
                .expect("forward");
            results.push(("forward", __values(state.output().as_slice())));
            let mut d_input = __X::<{ $l::BATCH_SIZE }>::zeros();
            layer
                .backward_input(&mut device, &state, &d_output, &mut d_input, mode)
                .expect("backward_input");
            results.push(("backward_input", __values(d_input.as_slice())));
            let mut grads = $grads::zeros();
            layer
                .backward(&mut device, &state, &x, &d_output, &mut grads, mode)
                .expect("backward");
            layer
                .backward_full(
                    &mut device,
                    &state,
                    &x,
                    &d_output,
                    &mut d_input,
                    &mut grads,
                    mode,
                )
                .expect("backward_full");
            results.push(("backward_full d_input", __values(d_input.as_slice())));
            ::conv_runtime::Parameters::visit_mut(&mut layer, &grads, &mut |_, _, g| {
                results.push(("gradient", __values(g)));
            });
        }
        // The running statistics the training forward passes updated.
        let mut copy = ::core::clone::Clone::clone(&layer);
        ::conv_runtime::Parameters::visit_buffers_mut(&mut copy, &mut |_, b| {
            results.push((
                "running statistics",
                __values(::conv_runtime::ParamTensor::values(b)),
            ));
        });
        results
    }};
}

/// Bit-identical results, operation by operation.
pub fn same_bits(what: &str, ours: &[(&str, Vec<f64>)], theirs: &[(&str, Vec<f64>)]) {
    ::core::assert_eq!(ours.len(), theirs.len());
    for ((op, a), (_, b)) in ours.iter().zip(theirs) {
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        ::core::assert!(same, "{what}: {op} differs");
    }
}
