//! Kubernetes' rules for names and label values, as kube-apiserver checks them
//! (`k8s.io/apimachinery/pkg/util/validation/validation.go`: `IsDNS1123Label`,
//! `IsDNS1123Subdomain`, `IsValidLabelValue`). Whatever faultline turns into an object
//! name or a label value is checked here first, at start, so a bad flag is a clear error
//! instead of 422s on every write.

/// At most this many characters in a DNS-1123 label (and a label value).
pub const LABEL_MAX: usize = 63;
/// At most this many characters in a DNS-1123 subdomain (most object names).
pub const SUBDOMAIN_MAX: usize = 253;

fn alnum_lower(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// Lowercase letters, digits and `-`, starting and ending with a letter or digit (the
/// rule of a DNS-1123 label, and of each part of a subdomain), any length.
fn label_chars(l: &str) -> bool {
    !l.is_empty()
        && l.chars().all(|c| alnum_lower(c) || c == '-')
        && l.starts_with(alnum_lower)
        && l.ends_with(alnum_lower)
}

/// Why a name is not one the API server takes (its own words, from
/// staging/src/k8s.io/apimachinery/pkg/util/validation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty, or longer than `max`.
    #[error("{value:?} must be 1 to {max} characters (a {what})")]
    Length {
        /// The name.
        value: String,
        /// The most characters it may have.
        max: usize,
        /// What it must be (`DNS-1123 label`).
        what: &'static str,
    },
    /// A character the kind of name does not take, or one at either end.
    #[error("{value:?} must be {rule} (a {what})")]
    Characters {
        /// The name.
        value: String,
        /// What it may be made of.
        rule: &'static str,
        /// What it must be.
        what: &'static str,
    },
}

/// Whether `v` is a DNS-1123 label: 1 to 63 lowercase letters, digits and `-`, starting
/// and ending with a letter or digit; what is wrong, if not.
pub fn dns_label(v: &str) -> Result<(), NameError> {
    const WHAT: &str = "DNS-1123 label";
    if v.is_empty() || v.len() > LABEL_MAX {
        return Err(NameError::Length {
            value: v.into(),
            max: LABEL_MAX,
            what: WHAT,
        });
    }
    if label_chars(v) {
        Ok(())
    } else {
        Err(NameError::Characters {
            value: v.into(),
            rule: "lowercase letters, digits and '-', starting and ending with a letter or digit",
            what: WHAT,
        })
    }
}

/// Whether `v` is a DNS-1123 subdomain: at most 253 characters of DNS-1123 labels joined
/// by `.` (each label here may be up to 253 long, as upstream's regular expression
/// allows); what is wrong, if not.
pub fn dns_subdomain(v: &str) -> Result<(), NameError> {
    const WHAT: &str = "DNS-1123 subdomain";
    if v.is_empty() || v.len() > SUBDOMAIN_MAX {
        return Err(NameError::Length {
            value: v.into(),
            max: SUBDOMAIN_MAX,
            what: WHAT,
        });
    }
    if v.split('.').all(label_chars) {
        Ok(())
    } else {
        Err(NameError::Characters {
            value: v.into(),
            rule: "lowercase letters, digits, '-' and '.', each part starting and ending with a letter or digit",
            what: WHAT,
        })
    }
}

/// Whether `v` is a valid label value: empty, or at most 63 letters, digits, `-`, `_`
/// and `.`, starting and ending with a letter or digit; what is wrong, if not.
pub fn label_value(v: &str) -> Result<(), NameError> {
    if v.is_empty() {
        return Ok(());
    }
    let alnum = |c: char| c.is_ascii_alphanumeric();
    let ok = v.len() <= LABEL_MAX
        && v.chars().all(|c| alnum(c) || matches!(c, '-' | '_' | '.'))
        && v.starts_with(alnum)
        && v.ends_with(alnum);
    if ok {
        Ok(())
    } else {
        Err(NameError::Characters {
            value: v.into(),
            rule: "at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit",
            what: "label value",
        })
    }
}

/// A name not given by flag (a hostname may have capitals or `_`) made a DNS-1123
/// subdomain: each `.`-separated part lowercase, anything else `-`, no `-` at either end
/// of a part, empty parts dropped. Too long a result is left for the caller to refuse.
pub fn as_subdomain(s: &str) -> String {
    s.split('.')
        .map(|part| {
            let mapped: String = part
                .chars()
                .map(|c| match c.to_ascii_lowercase() {
                    c @ ('a'..='z' | '0'..='9') => c,
                    _ => '-',
                })
                .collect();
            mapped.trim_matches('-').to_string()
        })
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(".")
}

/// Why a token file was refused; the message names the path.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Empty, or more than one word.
    #[error("{path}: the token must be one word")]
    NotOneWord {
        /// The file.
        path: String,
    },
}

/// A bearer token from `path`: its content trimmed, one word (no whitespace or control
/// characters inside, not empty). The error names the path.
pub fn read_token(path: &std::path::Path) -> Result<String, TokenError> {
    let t = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let t = t.trim();
    if t.is_empty() || t.contains(|c: char| c.is_whitespace() || c.is_control()) {
        return Err(TokenError::NotOneWord {
            path: path.display().to_string(),
        });
    }
    Ok(t.to_string())
}

/// The token of an `Authorization` header's value with the `Bearer` scheme: the scheme
/// matched without regard to case (RFC 9110 section 11.1: "It uses a case-insensitive
/// token"; `bearer` was refused), then one or more spaces, then the token
/// (RFC 6750 section 2.1), surrounding whitespace trimmed. `None` for another scheme or
/// no token.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.starts_with(b" ") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cases of upstream's validation_test.go that apply, and their edges.
    #[test]
    fn names_and_label_values_as_the_api_server_checks_them() {
        for ok in ["a", "0", "faultline", "a-b", "a1-2b", &"a".repeat(63)] {
            assert_eq!(dns_label(ok), Ok(()), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "a b", &"a".repeat(64)] {
            assert!(dns_label(bad).is_err(), "{bad}");
        }
        for ok in ["a", "a.b", "gpu-node-1.example", &"a".repeat(253)] {
            assert_eq!(dns_subdomain(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "A.b",
            "a_b",
            "-a.b",
            &"a".repeat(254),
        ] {
            assert!(dns_subdomain(bad).is_err(), "{bad}");
        }
        for ok in ["", "a", "A_b.c-D", "1", &"a".repeat(63)] {
            assert_eq!(label_value(ok), Ok(()), "{ok}");
        }
        for bad in ["-a", "a_", "a b", "a/b", &"a".repeat(64)] {
            assert!(label_value(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for (header, want) in [
            (&b"Bearer abc"[..], Some(&b"abc"[..])),
            (b"bearer abc", Some(b"abc")),
            (b"BEARER   abc ", Some(b"abc")),
            (b"Bearerabc", None),
            (b"Basic abc", None),
            (b"Bearer ", None),
            (b"Bear", None),
        ] {
            assert_eq!(
                bearer_token(header),
                want,
                "{:?}",
                String::from_utf8_lossy(header)
            );
        }
    }
}
