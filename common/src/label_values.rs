//! [`label_values!`](crate::label_values): a metric label with a closed set of values,
//! as an enum, so a label can only take the values its help text promises.

/// An enum of label values with `as_str` and `prometheus_client`'s
/// `EncodeLabelValue`. The calling crate depends on `prometheus-client`.
///
/// ```ignore
/// faultline_common::label_values!(
///     /// How a request ended.
///     Outcome { Ok => "ok", Error => "error" }
/// );
/// ```
#[macro_export]
macro_rules! label_values {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vm])* $variant),+
        }

        impl $name {
            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl ::prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(
                &self,
                encoder: &mut ::prometheus_client::encoding::LabelValueEncoder,
            ) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    };
}
