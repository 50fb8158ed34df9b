//! `kmsg`: follow the kernel log for NVRM Xid lines.
//!
//! `/dev/kmsg` (a character device) is read record by record from the start of the
//! kernel's ring buffer, with each record's own timestamp, so an Xid printed shortly
//! before the agent (re)started still counts within its window; a reopen skips records
//! already seen (by sequence number). A plain file is followed from its end like
//! `tail -F` (an old syslog must not replay as new faults) and resumed where it was
//! after an error; after rotation or truncation the new file is read from its start.
//! A FIFO is read as written.
//!
//! A /dev/kmsg record goes to the parser whole, with its sequence number: only its first
//! line starts a kernel message (a process's name or file name can put any text on the
//! lines after it), and the probe-time "fallen off the bus" message is read only from
//! one record or from records with consecutive numbers ([`parser`] has the rules and
//! the driver's templates).
//!
//! Like NVML's event thread, kmsg reports through an [`EventSink`]: each Xid line as an
//! event, and its own status (registered as a stream, up once the log is open, down
//! with the error while it cannot be read). It never touches the store.

pub mod parser;
mod source;

pub use source::*;
