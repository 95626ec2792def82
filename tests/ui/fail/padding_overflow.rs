    pub struct Layer {
        input: [8, 8, 3],
        out_channels: 6,
        kernel: 3,
        padding: 9223372036854775808,
    }
}

fn main() {}
