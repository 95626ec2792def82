//! Integration tests, examples and benchmarks of `conv2d!`; the library itself is
//! `conv_runtime`. The README's code is compiled and run as this crate's doc test.
#![doc = include_str!("../README.md")]
