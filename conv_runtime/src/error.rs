//! Runtime errors: each names the operation that failed and why.

use std::fmt;

/// A failed operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// The operation or library call, e.g. `"oneDNN convolution forward primitive"`.
    pub operation: String,
    /// What went wrong.
    pub reason: String,
}

impl Error {
    /// An error for `operation` with `reason`.
    pub fn new(operation: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            operation: operation.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.operation, self.reason)
    }
}

impl std::error::Error for Error {}

impl From<crate::tensor::ShapeError> for Error {
    fn from(e: crate::tensor::ShapeError) -> Self {
        Self::new("tensor construction", e.to_string())
    }
}

/// Result of a layer operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;
