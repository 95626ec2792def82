use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    /// 8x8x3 -> 6x6x4.
    pub struct First {
        input: [8, 8, 3],
        out_channels: 4,
        kernel: 3,
        activation: Relu,
    }
}

conv_runtime::conv2d! {
    /// 6x6x4 -> 3x3x2: takes exactly what `First` produces.
    pub struct Second {
        input: [6, 6, 4],
        out_channels: 2,
        kernel: 3,
        stride: 2,
        padding: 1,
    }
}

fn main() {
    let mut cpu = Cpu::default();
    let mut rng = Rng::seed_from_u64(0);
    let first = First::new(&mut rng);
    let second = Second::new(&mut rng);
    // `evaluate` takes any batch, not only the spec's training batch (1 here).
    let x = Tensor::<f32, 2, 8, 8, 3>::zeros();
    let mut h = Tensor::<f32, 2, 6, 6, 4>::zeros();
    let mut y = Tensor::<f32, 2, 3, 3, 2>::zeros();
    first.evaluate(&mut cpu, &x, &mut h).unwrap();
    second.evaluate(&mut cpu, &h, &mut y).unwrap();
    assert_eq!(
        (First::OUTPUT_HEIGHT, First::OUTPUT_WIDTH, First::OUTPUT_CHANNELS),
        (Second::INPUT_HEIGHT, Second::INPUT_WIDTH, Second::INPUT_CHANNELS),
    );
    assert_eq!(y.as_slice().len(), 2 * 3 * 3 * 2);
}
