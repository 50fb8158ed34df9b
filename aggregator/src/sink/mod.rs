//! Where fault documents go.

pub mod file;
