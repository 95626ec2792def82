    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: 3,
        norm: BatchNorm { momentum: -0.5, eps: 0 },
    }
}

fn main() {}
