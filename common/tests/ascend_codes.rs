//! The site's Ascend fault-code file (`--ascend-fault-codes`) and
//! the codes the vendor tools print, by property. What a site writes in the file's
//! format reads back as written (round trip through the grade the agent publishes);
//! a line that is not in the format is an error naming its line, never a panic and
//! never half a table.

use faultline_common::ascend::{parse_code, Catalog, Level};
use faultline_common::DeviceStatus;
use proptest::prelude::*;

const LEVELS: [Level; 9] = [
    Level::NotHandleFault,
    Level::SubHealthFault,
    Level::RestartRequest,
    Level::RestartBusiness,
    Level::FreeRestartNPU,
    Level::RestartNPU,
    Level::PreSeparateNPU,
    Level::SeparateNPU,
    Level::ManuallySeparateNPU,
];
const STATUSES: [(&str, DeviceStatus); 3] = [
    ("failed", DeviceStatus::Failed),
    ("degraded", DeviceStatus::Degraded),
    ("healthy", DeviceStatus::Healthy),
];

/// One row as a site writes it: code, level, maybe a status, maybe a reason.
#[derive(Debug, Clone)]
struct Line {
    code: u32,
    level: usize,
    status: Option<usize>,
    reason: Option<String>,
    /// How the code is spelled: 0 `8C03A000`, 1 `0x8c03a000`, 2 `0X...` with no zero padding.
    spelling: u8,
    tab: bool,
}

fn line() -> impl Strategy<Value = Line> {
    (
        1u32..,
        0usize..9,
        prop::option::of(0usize..3),
        prop::option::of("[a-z][a-z0-9-]{0,20}"),
        0u8..3,
        any::<bool>(),
    )
        .prop_map(|(code, level, status, reason, spelling, tab)| Line {
            code,
            level,
            // A reason is the fourth column: it needs the third.
            status: status.or(reason.as_ref().map(|_| 0)),
            reason,
            spelling,
            tab,
        })
}

fn write(l: &Line) -> String {
    let code = match l.spelling {
        0 => format!("{:08X}", l.code),
        1 => format!("0x{:08x}", l.code),
        _ => format!("0X{:X}", l.code),
    };
    let mut f = vec![code, LEVELS[l.level].as_str().to_string()];
    f.extend(l.status.map(|s| STATUSES[s].0.to_string()));
    f.extend(l.reason.clone());
    f.join(if l.tab { "\t" } else { "  " })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Every row written reads back: the last row of a code wins, and the grade the
    /// agent publishes names the code as the vendor prints it, which parses back.
    #[test]
    fn a_written_file_reads_back_row_by_row(
        lines in prop::collection::vec(line(), 0..20),
        comments in prop::collection::vec(any::<bool>(), 20),
    ) {
        let mut text = String::new();
        for (l, c) in lines.iter().zip(&comments) {
            if *c {
                text.push_str("# a comment\n\n");
            }
            text.push_str(&write(l));
            text.push('\n');
        }
        let cat = Catalog::with_overrides(&text).unwrap();
        for (i, l) in lines.iter().enumerate() {
            if lines[i + 1..].iter().any(|later| later.code == l.code) {
                continue;
            }
            let level = LEVELS[l.level];
            let row = cat.row(l.code).unwrap();
            prop_assert_eq!(row.level, level);
            prop_assert_eq!(row.status, l.status.map_or(level.default_status(), |s| STATUSES[s].1));
            prop_assert_eq!(&row.reason, l.reason.as_deref().unwrap_or(level.default_reason()));
            let graded = cat.grade(l.code);
            prop_assert_eq!(parse_code(&graded.code), Some(l.code));
        }
    }

    /// A line changed at random: the file either reads or is refused naming a line
    /// (1-based, within the file); never a panic.
    #[test]
    fn a_garbled_line_is_refused_by_number(
        lines in prop::collection::vec(line(), 1..8),
        which in any::<prop::sample::Index>(),
        garbage in "[ -~\t]{0,40}",
    ) {
        let mut text: Vec<String> = lines.iter().map(write).collect();
        let i = which.index(text.len());
        text[i] = garbage;
        match Catalog::with_overrides(&text.join("\n")) {
            Ok(_) => {}
            Err(e) => {
                prop_assert_eq!(e.line, i + 1, "{}", e);
                let prefix = format!("line {}: ", i + 1);
                prop_assert!(e.to_string().starts_with(&prefix), "{}", e);
            }
        }
    }

    /// A code reads back from every way it is printed, and nothing but up to 8 hex
    /// digits (after an optional `0x`) reads as one.
    #[test]
    fn codes_read_as_printed_and_nothing_else(code: u32, s in "[0-9a-fA-FxX+ -]{0,12}") {
        for printed in [format!("{code:08X}"), format!("{code:x}"), format!("0x{code:08x}"), format!("0X{code:X}")] {
            prop_assert_eq!(parse_code(&printed), Some(code));
        }
        if let Some(c) = parse_code(&s) {
            let t = s.trim();
            let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
            prop_assert!(!digits.is_empty() && digits.len() <= 8 && digits.bytes().all(|b| b.is_ascii_hexdigit()), "{:?}", s);
            prop_assert_eq!(u32::from_str_radix(digits, 16).ok(), Some(c));
        }
    }
}

#[test]
fn a_signed_code_is_not_a_code() {
    assert_eq!(parse_code("+1"), None);
    assert_eq!(parse_code("0x+1"), None);
    assert_eq!(parse_code("-1"), None);
}
