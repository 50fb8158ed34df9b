//! `--sink file --out DIR`: a directory laid out the way kubelet lays out a ConfigMap
//! volume (`atomic_writer.go`): the files live in a timestamped directory, `..data` is a
//! symlink to it swapped atomically by rename, and each key is a symlink through
//! `..data`. A reader sees the old set of files or the new one, never a mix, and a
//! local consumer sees exactly what a pod sees. Watch the directory (or `..data`), not
//! a file: the file itself is never modified in place.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// Keys that are valid file names (ConfigMap keys: `[-._a-zA-Z0-9]+`, not `.`/`..`).
pub fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k != "."
        && k != ".."
        && !k.starts_with("..")
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
}

/// Write `files` into `dir` atomically.
pub fn write(dir: &Path, files: &BTreeMap<String, Vec<u8>>) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for k in files.keys() {
        if !valid_key(k) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("invalid key {k:?}"),
            ));
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let ts = format!(
        "..{}_{:09}_{}",
        now.as_secs(),
        now.subsec_nanos(),
        std::process::id()
    );
    let ts_dir = dir.join(&ts);
    std::fs::create_dir(&ts_dir)?;
    for (k, v) in files {
        std::fs::write(ts_dir.join(k), v)?;
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(&ts, &tmp)?;
    let old = std::fs::read_link(dir.join("..data")).ok();
    std::fs::rename(&tmp, dir.join("..data"))?;
    for k in files.keys() {
        let link = dir.join(k);
        if std::fs::symlink_metadata(&link).is_err() {
            symlink(PathBuf::from("..data").join(k), &link)?;
        }
    }
    // Keys that are gone, and the previous timestamped directory.
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("..") && !files.contains_key(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(old) = old.filter(|o| o != Path::new(&ts)) {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(kv: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn swaps_whole_sets_through_data() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &files(&[("fault.json", "1"), ("n1.json", "a")])).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("fault.json")).unwrap(),
            "1"
        );
        let first = std::fs::read_link(d.path().join("..data")).unwrap();
        write(d.path(), &files(&[("fault.json", "2"), ("n2.json", "b")])).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("fault.json")).unwrap(),
            "2"
        );
        assert_eq!(
            std::fs::read_to_string(d.path().join("n2.json")).unwrap(),
            "b"
        );
        assert!(
            !d.path().join("n1.json").exists(),
            "a key that is gone is removed"
        );
        assert!(
            !d.path().join(&first).exists(),
            "the old directory is removed"
        );
        // The key is a symlink through ..data, as kubelet makes it.
        assert_eq!(
            std::fs::read_link(d.path().join("fault.json")).unwrap(),
            PathBuf::from("..data/fault.json")
        );
        let entries = std::fs::read_dir(d.path()).unwrap().count();
        assert_eq!(entries, 4, "..data, one timestamped dir, two keys");
    }

    #[test]
    fn rejects_keys_that_escape() {
        let d = tempfile::tempdir().unwrap();
        for bad in ["../x", "a/b", "..data", "", "."] {
            assert!(write(d.path(), &files(&[(bad, "x")])).is_err(), "{bad}");
        }
    }
}
