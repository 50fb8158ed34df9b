//! Signed deliveries: only the aggregator can set a node's verdict.
//!
//! The delivery token is shared by every agent, so a node that is compromised holds it
//! and could speak for any other node. The aggregator therefore also signs each delivery
//! with an Ed25519 key only it holds (`--delivery-signing-key-file`), and each agent
//! holds the public key alone (`--delivery-key-file`). The signature covers the body's
//! exact bytes: the node addressed, the writer, its sequence, when it was sent, the
//! entry and the entry's digest. It travels in the `Faultline-Signature` header as
//! `ed25519=<base64>`, so the body stays the JSON that older agents parse.
//!
//! Keys are PEM, as OpenSSL writes them: `openssl genpkey -algorithm ed25519` gives the
//! private key (PKCS#8, `PRIVATE KEY`), `openssl pkey -pubout` its public key
//! (`PUBLIC KEY`). A public key file may hold several keys, for a rotation: the agents
//! take the new one beside the old, then the aggregator signs with the new one.
//!
//! [`Reloaded`] re-reads such a file when it changes (a Secret's or ConfigMap's
//! volume update), so tokens and keys rotate without restarts; a file that no longer
//! parses keeps the last good one in force.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use ring::signature::{Ed25519KeyPair, KeyPair as _, UnparsedPublicKey, ED25519};

use crate::sync::Locked;

/// The header that carries a delivery's signature.
pub const SIGNATURE_HEADER: &str = "faultline-signature";
/// The scheme of the header's value (`ed25519=<base64 of 64 bytes>`).
const SCHEME: &str = "ed25519=";
/// Most public keys one file may hold (a rotation needs two).
const MAX_KEYS: usize = 8;
/// How often a [`Reloaded`] file is looked at (its metadata) at most: a Secret's or
/// ConfigMap's volume changes once per kubelet sync (60-90 s), and the agent asks on
/// every request.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(1);
/// Largest key file read.
const MAX_KEY_FILE: u64 = 64 << 10;
/// DER of an Ed25519 SubjectPublicKeyInfo up to the key (RFC 8410).
const SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// Why a key file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The file cannot be read.
    #[error("{path}: {error}")]
    Read { path: String, error: String },
    /// No PEM block with the label expected.
    #[error("no PEM block `{0}` (Ed25519 keys as OpenSSL writes them)")]
    NoBlock(&'static str),
    /// A block that is not base64, or not an Ed25519 key.
    #[error("not an Ed25519 key: {0}")]
    Invalid(String),
    /// More keys than a rotation needs.
    #[error("{0} public keys, at most {MAX_KEYS}")]
    TooMany(usize),
}

/// Why a signature is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// No `Faultline-Signature` header.
    #[error("the delivery is not signed (no Faultline-Signature header)")]
    Missing,
    /// The header is not `ed25519=<base64 of 64 bytes>`.
    #[error("the Faultline-Signature header is not ed25519=<base64 signature>")]
    Malformed,
    /// No key held verifies it over this body.
    #[error("the delivery's signature is not the aggregator's")]
    Mismatch,
}

/// The aggregator's signing key.
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("public", &STANDARD.encode(self.pair.public_key().as_ref()))
            .finish()
    }
}

impl SigningKey {
    /// From a PEM `PRIVATE KEY` block (PKCS#8 v1 as OpenSSL writes it, or v2).
    pub fn from_pem(text: &str) -> Result<Self, KeyError> {
        let der = pem_blocks(text, "PRIVATE KEY")?
            .into_iter()
            .next()
            .ok_or(KeyError::NoBlock("PRIVATE KEY"))?;
        let pair = Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der)
            .map_err(|e| KeyError::Invalid(e.to_string()))?;
        Ok(SigningKey { pair })
    }

    /// A new key pair: (private key PEM, public key PEM).
    pub fn generate_pem() -> Result<(String, String), KeyError> {
        let rng = ring::rand::SystemRandom::new();
        let doc =
            Ed25519KeyPair::generate_pkcs8(&rng).map_err(|e| KeyError::Invalid(e.to_string()))?;
        let key = SigningKey::from_pem(&pem("PRIVATE KEY", doc.as_ref()))?;
        Ok((pem("PRIVATE KEY", doc.as_ref()), key.public_pem()))
    }

    /// The public key, as `openssl pkey -pubout` writes it.
    pub fn public_pem(&self) -> String {
        let mut der = SPKI_PREFIX.to_vec();
        der.extend_from_slice(self.pair.public_key().as_ref());
        pem("PUBLIC KEY", &der)
    }

    /// The `Faultline-Signature` header value of `body`.
    pub fn sign(&self, body: &[u8]) -> String {
        format!("{SCHEME}{}", STANDARD.encode(self.pair.sign(body).as_ref()))
    }
}

/// The public keys an agent takes signatures of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyingKeys(Vec<[u8; 32]>);

impl VerifyingKeys {
    /// No key: nothing verifies.
    pub fn none() -> Self {
        VerifyingKeys(Vec::new())
    }

    /// From one or more PEM `PUBLIC KEY` blocks (SubjectPublicKeyInfo, Ed25519).
    pub fn from_pem(text: &str) -> Result<Self, KeyError> {
        let blocks = pem_blocks(text, "PUBLIC KEY")?;
        if blocks.len() > MAX_KEYS {
            return Err(KeyError::TooMany(blocks.len()));
        }
        let keys = blocks
            .iter()
            .map(|der| {
                der.strip_prefix(&SPKI_PREFIX[..])
                    .and_then(|k| <[u8; 32]>::try_from(k).ok())
                    .ok_or_else(|| KeyError::Invalid("a PUBLIC KEY that is not Ed25519".into()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VerifyingKeys(keys))
    }

    /// Whether `header` (the `Faultline-Signature` value) is a signature of `body` by
    /// one of the keys.
    pub fn verify(&self, body: &[u8], header: Option<&[u8]>) -> Result<(), SealError> {
        let value = header.ok_or(SealError::Missing)?;
        let sig = value
            .trim_ascii()
            .strip_prefix(SCHEME.as_bytes())
            .and_then(|b| STANDARD.decode(b).ok())
            .filter(|s| s.len() == 64)
            .ok_or(SealError::Malformed)?;
        let good = self.0.iter().any(|k| {
            UnparsedPublicKey::new(&ED25519, k)
                .verify(body, &sig)
                .is_ok()
        });
        if good {
            Ok(())
        } else {
            Err(SealError::Mismatch)
        }
    }
}

/// The digest of an entry's JSON: what a confirmation names.
pub fn digest(json: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, json);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in d.as_ref() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The DER of every `label` block of `text`, in order.
fn pem_blocks(text: &str, label: &'static str) -> Result<Vec<Vec<u8>>, KeyError> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(&begin) {
        let body = &rest[at + begin.len()..];
        let stop = body
            .find(&end)
            .ok_or_else(|| KeyError::Invalid(format!("{begin} without {end}")))?;
        let b64: String = body[..stop]
            .chars()
            .filter(|c| !c.is_ascii_whitespace())
            .collect();
        out.push(
            STANDARD
                .decode(b64)
                .map_err(|e| KeyError::Invalid(format!("{label}: {e}")))?,
        );
        rest = &body[stop + end.len()..];
    }
    if out.is_empty() {
        return Err(KeyError::NoBlock(label));
    }
    Ok(out)
}

/// What identifies a version of a file: modification time, length, inode.
type Stamp = (Option<SystemTime>, u64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok(), m.len(), m.ino()))
}

/// A file's parsed content, read again whenever the file changes.
pub struct Reloaded<T> {
    path: PathBuf,
    parse: fn(&str) -> Result<T, KeyError>,
    every: std::time::Duration,
    /// The file's version read, its value, and when the file was last looked at.
    held: Mutex<(Option<Stamp>, Arc<T>, std::time::Instant)>,
}

impl<T> Reloaded<T> {
    /// Read and parse `path` now: an error here is a start-up error.
    pub fn load(path: &Path, parse: fn(&str) -> Result<T, KeyError>) -> Result<Self, KeyError> {
        let s = stamp(path);
        let value = read(path, parse)?;
        Ok(Reloaded {
            path: path.to_path_buf(),
            parse,
            every: RECHECK,
            held: Mutex::new((s, Arc::new(value), std::time::Instant::now())),
        })
    }

    /// [`Reloaded::load`], or `missing` while there is no file at `path` (an optional
    /// Secret or ConfigMap not made yet): the file is looked for again as it would be
    /// on a change, and read once it appears. A file there that cannot be used is
    /// still a start-up error.
    pub fn load_or(
        path: &Path,
        parse: fn(&str) -> Result<T, KeyError>,
        missing: T,
    ) -> Result<Self, KeyError> {
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Reloaded {
                path: path.to_path_buf(),
                parse,
                every: RECHECK,
                held: Mutex::new((None, Arc::new(missing), std::time::Instant::now())),
            }),
            _ => Self::load(path, parse),
        }
    }

    /// Look at the file at most every `every` (tests: zero, every call).
    pub fn checking_every(mut self, every: std::time::Duration) -> Self {
        self.every = every;
        self
    }

    /// A value that never changes (tests, and values given on the command line).
    pub fn fixed(value: T) -> Self {
        Reloaded {
            path: PathBuf::new(),
            parse: |_| Err(KeyError::NoBlock("fixed")),
            every: RECHECK,
            held: Mutex::new((None, Arc::new(value), std::time::Instant::now())),
        }
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current value: read again when the file changed since it was last looked
    /// at (at most every second). A changed file that cannot be used keeps the last good
    /// value, and says why (once per change).
    pub fn get(&self) -> (Arc<T>, Option<KeyError>) {
        let mut held = self.held.locked();
        if self.path.as_os_str().is_empty() || held.2.elapsed() < self.every {
            return (held.1.clone(), None);
        }
        held.2 = std::time::Instant::now();
        let now = stamp(&self.path);
        if now == held.0 {
            return (held.1.clone(), None);
        }
        held.0 = now;
        match read(&self.path, self.parse) {
            Ok(v) => {
                held.1 = Arc::new(v);
                (held.1.clone(), None)
            }
            Err(e) => (held.1.clone(), Some(e)),
        }
    }
}

fn read<T>(path: &Path, parse: fn(&str) -> Result<T, KeyError>) -> Result<T, KeyError> {
    use std::io::Read as _;
    let err = |e: std::io::Error| KeyError::Read {
        path: path.display().to_string(),
        error: e.to_string(),
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(err)?
        .take(MAX_KEY_FILE)
        .read_to_string(&mut text)
        .map_err(err)?;
    parse(&text)
}

/// A token file's content, trimmed (empty: an error).
pub fn token(text: &str) -> Result<Vec<u8>, KeyError> {
    let t = text.trim_ascii();
    if t.is_empty() {
        return Err(KeyError::Invalid("the token file is empty".into()));
    }
    Ok(t.as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key pair as OpenSSL 3 writes it (`openssl genpkey -algorithm ed25519`, then
    /// `openssl pkey -pubout`), so the files users make are the files we read.
    const OPENSSL_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIDN/AYTTRnsUY7zZS7OtBoyZAFpqOAbIWOgGz+N/UJNy
-----END PRIVATE KEY-----
";
    const OPENSSL_PUBLIC: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEA6kej05U8isctRfDAcbTlaNx2+0+FCSi2u1hgIHH8GOM=
-----END PUBLIC KEY-----
";

    #[test]
    fn a_signature_verifies_over_the_exact_body_only() {
        let (private, public) = SigningKey::generate_pem().unwrap();
        let key = SigningKey::from_pem(&private).unwrap();
        let keys = VerifyingKeys::from_pem(&public).unwrap();
        let body = br#"{"writer":"a","sequence":1}"#;
        let sig = key.sign(body);
        assert_eq!(keys.verify(body, Some(sig.as_bytes())), Ok(()));
        // One byte changed, no header, garbage, another key: refused.
        let other = br#"{"writer":"a","sequence":2}"#;
        assert_eq!(
            keys.verify(other, Some(sig.as_bytes())),
            Err(SealError::Mismatch)
        );
        assert_eq!(keys.verify(body, None), Err(SealError::Missing));
        assert_eq!(
            keys.verify(body, Some(b"ed25519=not base64")),
            Err(SealError::Malformed)
        );
        assert_eq!(
            keys.verify(body, Some(b"hmac=AAAA")),
            Err(SealError::Malformed)
        );
        let (_, stranger) = SigningKey::generate_pem().unwrap();
        let strangers = VerifyingKeys::from_pem(&stranger).unwrap();
        assert_eq!(
            strangers.verify(body, Some(sig.as_bytes())),
            Err(SealError::Mismatch)
        );
        // A rotation: both keys in one file, either verifies.
        let both = VerifyingKeys::from_pem(&format!("{stranger}{public}")).unwrap();
        assert_eq!(both.verify(body, Some(sig.as_bytes())), Ok(()));
    }

    #[test]
    fn openssl_keys_are_read() {
        let key = SigningKey::from_pem(OPENSSL_PRIVATE).unwrap();
        assert_eq!(key.public_pem(), OPENSSL_PUBLIC);
        let keys = VerifyingKeys::from_pem(OPENSSL_PUBLIC).unwrap();
        let sig = key.sign(b"x");
        assert_eq!(keys.verify(b"x", Some(sig.as_bytes())), Ok(()));
        assert_eq!(
            SigningKey::from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
                .unwrap_err(),
            KeyError::NoBlock("PRIVATE KEY")
        );
        assert!(matches!(
            VerifyingKeys::from_pem("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"),
            Err(KeyError::Invalid(_))
        ));
    }

    #[test]
    fn a_changed_file_is_read_again_and_a_bad_one_keeps_the_last_good() {
        let dir = tempdir();
        let path = dir.join("token");
        std::fs::write(&path, "one\n").unwrap();
        let r = Reloaded::load(&path, token)
            .unwrap()
            .checking_every(std::time::Duration::ZERO);
        assert_eq!(*r.get().0, b"one");
        std::fs::write(&path, "second\n").unwrap();
        assert_eq!(*r.get().0, b"second");
        std::fs::write(&path, "   \n").unwrap();
        let (v, e) = r.get();
        assert_eq!(*v, b"second");
        assert!(e.is_some());
        // Said once per change.
        assert!(r.get().1.is_none());
        // By default the file is looked at once a second at most: a change this instant
        // is not read yet.
        std::fs::write(&path, "third\n").unwrap();
        let slow = Reloaded::load(&path, token).unwrap();
        std::fs::write(&path, "fourth\n").unwrap();
        assert_eq!(*slow.get().0, b"third");
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "faultline-seal-{}-{}",
            std::process::id(),
            crate::time::now_ms()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_digest_is_sha256_of_the_bytes() {
        assert_eq!(
            digest(b"abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
