use conv_runtime::prelude::*;

conv_runtime::conv2d! {
    /// 8x8x3 -> 6x6x4.
    pub struct First {
        input: [8, 8, 3],
        out_channels: 4,
        kernel: 3,
    }
}

conv_runtime::conv2d! {
    /// Expects 8x8x4, but `First` produces 6x6x4.
    pub struct Second {
        input: [8, 8, 4],
        out_channels: 2,
        kernel: 3,
    }
}

fn main() {
    let mut cpu = Cpu::default();
    let mut rng = Rng::seed_from_u64(0);
    let first = First::new(&mut rng);
    let second = Second::new(&mut rng);
    let x = Tensor::<f32, 2, 8, 8, 3>::zeros();
    let mut h = Tensor::<f32, 2, 6, 6, 4>::zeros();
    let mut y = Tensor::<f32, 2, 6, 6, 2>::zeros();
    first.evaluate(&mut cpu, &x, &mut h).unwrap();
    second.evaluate(&mut cpu, &h, &mut y).unwrap();
}
