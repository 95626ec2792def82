//! Integration tests, examples and benchmarks of `conv2d!`; the library itself is `conv_runtime`.
