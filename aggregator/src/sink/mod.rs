//! Where fault documents go.

pub mod configmap;
pub mod file;
