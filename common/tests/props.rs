//! Property tests for the shared parsers: none panics on any input, and
//! what they return is bounded and well formed.

use faultline_common::reading::normalize_bus_id;
use faultline_common::time::parse_duration;
use proptest::prelude::*;

fn well_formed_bus(s: &str) -> bool {
    let b = s.as_bytes();
    s.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| [4, 7, 10].contains(&i) || c.is_ascii_digit() || ('a'..='f').contains(&c))
}

proptest! {
    /// Any text: `None`, or `dddd:bb:dd.f` in lowercase, and normalising again keeps it.
    #[test]
    fn bus_ids_normalise_to_one_form(raw in ".{0,40}") {
        if let Some(b) = normalize_bus_id(&raw) {
            prop_assert!(well_formed_bus(&b), "{b:?} from {raw:?}");
            prop_assert_eq!(normalize_bus_id(&b), Some(b.clone()));
        }
    }

    /// The spellings of NVML, the kernel and npu-smi agree.
    #[test]
    fn bus_id_spellings_agree(domain in 0u32..=0xffff, bus in 0u32..=0xff, dev in 0u32..=0x1f, func in 0u32..=7) {
        let nvml = format!("{domain:08X}:{bus:02X}:{dev:02X}.{func}");
        let kernel = format!("PCI:{domain:04x}:{bus:02x}:{dev:02x}.{func}");
        let smi = format!("{domain:04X}:{bus:02x}:{dev:02X}.{func}");
        let want = normalize_bus_id(&nvml);
        prop_assert!(want.is_some());
        prop_assert_eq!(normalize_bus_id(&kernel), want.clone());
        prop_assert_eq!(normalize_bus_id(&smi), want);
    }

    /// Durations: any text parses or not, without a panic or an overflow.
    #[test]
    fn durations_never_panic(raw in ".{0,30}", n in any::<u64>(), unit in prop::sample::select(vec!["ms", "s", "m", "h", "d", ""])) {
        let _ = parse_duration(&raw);
        let _ = parse_duration(&format!("{n}{unit}"));
    }
}
