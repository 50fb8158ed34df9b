//! Nothing to call: this crate only enables features (see its Cargo.toml).
