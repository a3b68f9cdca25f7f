//! An access log of admitted requests, for counting what a fleet admitted
//! window by window by the instant each Envoy let a request through.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// An access log at [`AdmissionLog::path`] of every request answered 200,
/// each line the instant Envoy began to answer it (the stream's start plus
/// the time to the response's first byte, which a direct response sends as
/// soon as the filter lets the request through), in nanoseconds since the
/// epoch, and optionally a request header's value.
#[derive(Clone, Debug)]
pub struct AdmissionLog {
    /// The log file.
    pub path: PathBuf,
    /// The request header logged with each admission (e.g. `x-user`), if any.
    pub header: Option<String>,
}

/// One admitted request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// When Envoy began to answer it, in nanoseconds since the epoch.
    pub at_ns: u64,
    /// The logged header's value (`-` when the request had none).
    pub header: Option<String>,
}

impl AdmissionLog {
    /// A log to `path`, with `header`'s value on each line if given; any
    /// file already there is removed.
    pub fn new(path: &Path, header: Option<&str>) -> AdmissionLog {
        let _ = std::fs::remove_file(path);
        AdmissionLog { path: path.to_path_buf(), header: header.map(str::to_string) }
    }

    /// The connection manager's `access_log` field that writes it.
    pub fn access_log(&self) -> Value {
        let header = self.header.as_ref().map(|name| format!(" %REQ({})%", name.to_ascii_uppercase()));
        let format =
            format!("%START_TIME(%s.%9f)% %COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:ns)%{}\n", header.unwrap_or_default());
        json!([{
            "name": "envoy.access_loggers.file",
            "filter": {"status_code_filter": {"comparison": {
                "op": "EQ",
                "value": {"default_value": 200, "runtime_key": "e2e.admitted"},
            }}},
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": self.path.display().to_string(),
                "log_format": {"text_format_source": {"inline_string": format}},
            },
        }])
    }

    /// The admissions logged so far (none if the file is not there yet).
    pub fn read(&self) -> Vec<Admission> {
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        text.lines()
            .map(|line| {
                let mut fields = line.split(' ');
                let (start, to_answer) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
                let (secs, nanos) = start.split_once('.').unwrap_or_else(|| panic!("bad log line {line:?}"));
                let number = |text: &str| -> u64 { text.parse().unwrap_or_else(|_| panic!("bad log line {line:?}")) };
                let at_ns = number(secs) * 1_000_000_000 + number(nanos) + number(to_answer);
                Admission { at_ns, header: self.header.as_ref().and(fields.next()).map(str::to_string) }
            })
            .collect()
    }
}
