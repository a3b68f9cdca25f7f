//! `make plots`: the same scripted traffic, on one key, through a real Envoy
//! (two workers, loopback) for each algorithm, and per algorithm one SVG of
//! what happened to every request — offered, admitted, delayed and denied
//! over time — plus an overview of the rate algorithms side by side. From
//! the repository root:
//!
//! ```sh
//! cargo run -p floodgate-e2e --bin plots -- docs/plots
//! ```
//!
//! About 20 s per figure. Adding an algorithm (or another configuration of
//! one) is one entry in [`CASES`]; one the filter does not know yet is
//! skipped, and the run says so.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use floodgate_chart::{number, Axis, Figure, Legend, Mark, Panel, Scale};
use floodgate_e2e::bootstrap::fault_fixed_delay;
use floodgate_e2e::{repo_root, validate, Conn, Envoy, Setup};
use serde_json::{json, Map, Value};

/// Where a case's admitted requests go.
#[derive(Clone, Copy, Debug)]
enum Upstream {
    /// Envoy answers at once (`direct_response`), so any wait is the filter's.
    Direct,
    /// Envoy's fault filter, after Floodgate, holds each admitted request
    /// this long before the answer: a slow upstream.
    Slow { millis: u64 },
}

/// One figure: its name (and its file's), the rule without its `name`
/// (JSON), and the upstream the script runs against.
struct Case {
    name: &'static str,
    rule: &'static str,
    upstream: Upstream,
}

/// Every figure. The rate algorithms share one limit, 10 per 2 s, which the
/// script offers three times over; only what each does beyond that differs.
const CASES: &[Case] = &[
    Case {
        name: "token_bucket",
        rule: r#"{"algorithm": "token_bucket", "limit": 10, "period": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "leaky_bucket",
        rule: r#"{"algorithm": "leaky_bucket", "limit": 10, "period": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "fixed_window",
        rule: r#"{"algorithm": "fixed_window", "limit": 10, "period": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "sliding_window",
        rule: r#"{"algorithm": "sliding_window", "limit": 10, "period": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "sliding_window_sub_windows",
        rule: r#"{"algorithm": "sliding_window", "limit": 10, "period": "2s", "sub_windows": 4}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "sliding_log",
        rule: r#"{"algorithm": "sliding_log", "limit": 10, "period": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "shaper",
        rule: r#"{"algorithm": "shaper", "limit": 10, "period": "2s", "burst": 5, "max_delay": "2s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "warm_up",
        rule: r#"{"algorithm": "warm_up", "limit": 10, "period": "2s", "warmup": "8s"}"#,
        upstream: Upstream::Direct,
    },
    Case {
        name: "concurrency",
        rule: r#"{"algorithm": "concurrency", "limit": 5, "slot_ttl": "30s"}"#,
        upstream: Upstream::Slow { millis: 1000 },
    },
];

/// A part of the traffic script.
enum Phase {
    /// `count` requests sent together at `at` seconds.
    Burst { at: f64, count: usize },
    /// Requests evenly spaced from `from` until (not including) `until` seconds.
    Steady { from: f64, until: f64, per_second: f64 },
}

/// The traffic every case gets: a burst, three times the rate limit for
/// 10 s, a pause, and a second burst split either side of the window edge
/// at 16 s (where a fixed window lets two windows' worth through at once).
const SCRIPT: &[Phase] = &[
    Phase::Burst { at: 0.0, count: 30 },
    Phase::Steady { from: 1.0, until: 11.0, per_second: 15.0 },
    Phase::Burst { at: 15.9, count: 15 },
    Phase::Burst { at: 16.1, count: 15 },
];

/// The script starts on a multiple of this much Unix time, the rate cases'
/// period, so fixed windows begin on the figures' x ticks.
const WINDOW: Duration = Duration::from_secs(2);

/// A run whose sends were later than this (seconds) behind the script, on
/// a machine busy with other work, is run again, up to [`ATTEMPTS`] times.
const MAX_LATE: f64 = 0.05;
const ATTEMPTS: usize = 3;

/// Seconds each bar covers.
const BUCKET: f64 = 0.25;

/// Seconds each step of the overview's lines covers: coarser than a bar, so
/// its small panels read at a glance.
const OVERVIEW_BUCKET: f64 = 1.0;

const GREEN: &str = "#2e7d32";
const AMBER: &str = "#f29900";
const RED: &str = "#c62828";
const GREY: &str = "#8a8a8a";
const BLUE: &str = "#1565c0";
/// One colour per algorithm in the overview.
const PALETTE: &[&str] = &["#1565c0", "#2e7d32", "#c62828", "#f29900", "#6a1b9a", "#00838f", "#5d4037", "#ad1457"];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("plots: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let began = Instant::now();
    let out = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| repo_root().join("docs/plots"));
    fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let scratch = std::env::temp_dir().join(format!("floodgate-plots-{}", std::process::id()));
    fs::create_dir_all(&scratch).map_err(|e| format!("cannot create {}: {e}", scratch.display()))?;

    // Check every configuration first, so a bad entry fails before any traffic.
    let mut cases = Vec::new();
    for case in CASES {
        let setup = case.setup()?;
        match refusal(case, &setup, &scratch)? {
            None => cases.push((case, setup)),
            Some(reason) => println!("{}: skipped, the filter does not know it yet ({reason})", case.name),
        }
    }
    let _ = fs::remove_dir_all(&scratch);
    let plan = send_times();
    let mut runs = Vec::new();
    for (case, setup) in cases {
        let (requests, late) = case.run(&setup, &plan)?;
        println!("{}: {}; sends at most {:.0} ms late", case.name, Totals::of(&requests), late * 1000.0);
        runs.push(Run { case, requests, late });
    }

    // One time axis for every figure, so they compare at a glance.
    let step = WINDOW.as_secs_f64();
    let last = runs.iter().flat_map(|run| run.requests.iter().map(|r| r.answered)).fold(0.0, f64::max);
    let x_max = (last / step).ceil().max(1.0) * step;
    for run in &runs {
        write(&out.join(format!("{}.svg", run.case.name)), &run.figure(x_max).to_svg())?;
    }
    let rate_runs: Vec<&Run> = runs.iter().filter(|run| matches!(run.case.upstream, Upstream::Direct)).collect();
    write(&out.join("overview.svg"), &overview(&rate_runs, x_max).to_svg())?;
    println!("wrote {} figures to {} in {:.0} s", runs.len() + 1, out.display(), began.elapsed().as_secs_f64());
    Ok(())
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// The script as send times, in seconds from its start, in order.
fn send_times() -> Vec<f64> {
    let mut times = Vec::new();
    for phase in SCRIPT {
        match *phase {
            Phase::Burst { at, count } => times.extend(std::iter::repeat_n(at, count)),
            Phase::Steady { from, until, per_second } => {
                let count = ((until - from) * per_second).round() as usize;
                times.extend((0..count).map(|i| from + i as f64 / per_second));
            }
        }
    }
    times.sort_by(f64::total_cmp);
    times
}

/// The script in words, for the figures.
fn describe_script() -> String {
    let parts: Vec<String> = SCRIPT
        .iter()
        .map(|phase| match *phase {
            Phase::Burst { at, count } => format!("{count} at once at {at} s"),
            Phase::Steady { from, until, per_second } => format!("{per_second}/s from {from} to {until} s"),
        })
        .collect();
    format!("traffic on one key: {}", parts.join(", "))
}

/// Seconds in a duration as the configuration writes it ("500ms", "2s", "1m").
fn seconds(text: &str) -> Option<f64> {
    let digits = text.find(|c: char| !c.is_ascii_digit())?;
    let value: f64 = text[..digits].parse().ok()?;
    let unit = match &text[digits..] {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        _ => return None,
    };
    Some(value * unit)
}

impl Case {
    fn rule(&self) -> Result<Map<String, Value>, String> {
        serde_json::from_str(self.rule).map_err(|e| format!("{}: rule {:?}: {e}", self.name, self.rule))
    }

    fn setup(&self) -> Result<Setup, String> {
        let mut rule = self.rule()?;
        rule.insert("name".into(), json!("plot"));
        let mut setup = Setup::new(&json!({ "rules": [rule] }).to_string());
        if let Upstream::Slow { millis } = self.upstream {
            setup.filters_after.push(fault_fixed_delay(millis));
        }
        Ok(setup)
    }

    /// A number field of the rule.
    fn number(&self, name: &str) -> Option<f64> {
        self.rule().ok()?.get(name)?.as_f64()
    }

    /// A duration field of the rule, in seconds.
    fn duration(&self, name: &str) -> Option<f64> {
        seconds(self.rule().ok()?.get(name)?.as_str()?)
    }

    /// The upstream's own time per request, in seconds.
    fn upstream_secs(&self) -> f64 {
        match self.upstream {
            Upstream::Direct => 0.0,
            Upstream::Slow { millis } => millis as f64 / 1000.0,
        }
    }

    /// Runs the script on a fresh Envoy until the sends keep to it (or
    /// [`ATTEMPTS`] runs); returns the requests and how late the latest send was.
    fn run(&self, setup: &Setup, plan: &[f64]) -> Result<(Vec<Request>, f64), String> {
        let mut attempt = 1;
        loop {
            let requests = self.run_once(setup, plan)?;
            let late = requests.iter().zip(plan).map(|(r, at)| r.sent - at).fold(0.0, f64::max);
            if late <= MAX_LATE || attempt == ATTEMPTS {
                return Ok((requests, late));
            }
            println!("{}: a send was {:.0} ms behind the script (a busy machine); again", self.name, late * 1000.0);
            attempt += 1;
        }
    }

    /// Starts Envoy with this case, sends the script, and checks what the
    /// client saw against the filter's own counters.
    fn run_once(&self, setup: &Setup, plan: &[f64]) -> Result<Vec<Request>, String> {
        let envoy = Envoy::start(setup);
        let mut requests = drive(envoy.port, plan)?;
        let totals = Totals::of(&requests);
        let counted = |name: &str| envoy.stat(&format!("wasmcustom.floodgate.{name}")) as usize;
        let (allowed, limited, delayed) = (counted("allowed"), counted("limited"), counted("delayed"));
        if allowed != totals.admitted || limited != totals.denied || delayed > allowed {
            return Err(format!(
                "{}: the client got {} answers 200 and {} answers 429, but the filter counted {allowed} allowed \
                 ({delayed} of them delayed) and {limited} limited",
                self.name, totals.admitted, totals.denied
            ));
        }
        mark_delayed(&mut requests, delayed);
        Ok(requests)
    }
}

/// What one case's script run gave.
struct Run {
    case: &'static Case,
    requests: Vec<Request>,
    /// Seconds the latest send was behind the script.
    late: f64,
}

impl Run {
    fn figure(&self, x_max: f64) -> Figure {
        let (case, requests) = (self.case, &self.requests);
        let upstream = case.upstream_secs();
        let rate = case.number("limit").zip(case.duration("period"));
        let rate_label = |limit: f64, period: f64| format!("{} per {} s", number(limit), number(period));

        let mut bars = vec![Mark::Bars {
            width: BUCKET,
            series: vec![Legend::new("admitted", GREEN), Legend::new("delayed", AMBER), Legend::new("denied", RED)],
            bars: buckets(requests, x_max),
        }];
        if let Some((limit, period)) = rate {
            bars.push(reference(
                format!("limit, {} = {} per {BUCKET} s", rate_label(limit, period), number(limit * BUCKET / period)),
                limit * BUCKET / period,
                x_max,
            ));
        }
        let mut panels =
            vec![Panel { y: Axis::new(format!("requests sent per {BUCKET} s"), Scale::Linear), marks: bars }];

        match case.upstream {
            Upstream::Direct => {
                let mut marks = vec![
                    cumulative("offered", GREY, requests.iter().map(|r| r.sent), x_max),
                    cumulative(
                        "passed to the upstream",
                        GREEN,
                        requests.iter().filter_map(|r| r.passed(upstream)),
                        x_max,
                    ),
                    cumulative(
                        "denied",
                        RED,
                        requests.iter().filter(|r| r.fate == Fate::Denied).map(|r| r.sent),
                        x_max,
                    ),
                ];
                if let Some((limit, period)) = rate {
                    marks.push(Mark::Line {
                        legend: Legend::new(format!("{} from 0 s", rate_label(limit, period)), BLUE),
                        points: vec![(0.0, 0.0), (x_max, limit * x_max / period)],
                        step: false,
                        dashed: true,
                        width: 2.0,
                        markers: false,
                    });
                }
                panels.push(Panel { y: Axis::new("requests so far", Scale::Linear), marks });
            }
            Upstream::Slow { .. } => {
                let mut marks = vec![Mark::Line {
                    legend: Legend::new("in flight (admitted, not yet answered)", GREEN),
                    points: in_flight(requests),
                    step: true,
                    dashed: false,
                    width: 2.0,
                    markers: false,
                }];
                if let Some(limit) = case.number("limit") {
                    marks.push(reference(format!("limit, {}", number(limit)), limit, x_max));
                }
                panels.push(Panel { y: Axis::new("requests in flight", Scale::Linear), marks });
            }
        }

        if requests.iter().any(|r| r.fate == Fate::Delayed) {
            let waits = requests.iter().filter_map(|r| Some((r.sent, r.passed(upstream)? - r.sent))).collect();
            let mut marks =
                vec![Mark::Dots { legend: Legend::new("wait of each admitted request", AMBER), points: waits }];
            if let Some(max_delay) = case.duration("max_delay") {
                marks.push(reference(format!("max_delay, {} s", number(max_delay)), max_delay, x_max));
            }
            panels.push(Panel { y: Axis::new("wait before the upstream (s)", Scale::Linear), marks });
        }

        let mut subtitle = vec![describe_script(), format!("{}; Envoy's counters agree", Totals::of(requests))];
        if self.late > MAX_LATE {
            subtitle.push(format!("sends were up to {:.0} ms behind the script (a busy machine)", self.late * 1000.0));
        }
        if let Upstream::Slow { millis } = case.upstream {
            subtitle.push(format!("upstream: Envoy's fault filter holds each admitted request {millis} ms"));
        }
        Figure {
            title: format!("{}  {}", case.name, case.rule),
            subtitle,
            x: time_axis(x_max),
            plot_height: 180.0,
            panels,
        }
    }
}

/// Why the filter refuses the case's configuration, if because it does not
/// know the algorithm (`envoy --mode validate` runs the filter's
/// configuration check); an error for any other refusal.
fn refusal(case: &Case, setup: &Setup, scratch: &Path) -> Result<Option<String>, String> {
    let file = scratch.join(format!("{}.json", case.name));
    // Validation binds no port: any numbers do.
    write(&file, &setup.bootstrap(10000, 10001).to_string())?;
    let output = validate(&file);
    if output.status.success() {
        return Ok(None);
    }
    let log = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    match log.lines().find_map(|line| line.find("unknown algorithm").map(|at| &line[at..])) {
        Some(reason) => Ok(Some(reason.to_string())),
        None => Err(format!("{}: envoy --mode validate refused the configuration:\n{log}", case.name)),
    }
}

/// What the filter did with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    /// Passed at once.
    Admitted,
    /// Passed after a wait.
    Delayed,
    /// Answered 429.
    Denied,
}

/// One request as the client saw it: seconds from the script's start.
#[derive(Clone, Copy, Debug)]
struct Request {
    sent: f64,
    answered: f64,
    fate: Fate,
}

impl Request {
    /// A request as answered; [`mark_delayed`] tells which admitted ones waited.
    fn new(sent: f64, answered: f64, status: u16) -> Result<Self, String> {
        let fate = match status {
            429 => Fate::Denied,
            200 => Fate::Admitted,
            other => return Err(format!("the request sent at {sent:.3} s got status {other}")),
        };
        Ok(Self { sent, answered, fate })
    }

    /// When the filter let it go on to the upstream; `None` if denied.
    fn passed(&self, upstream_secs: f64) -> Option<f64> {
        (self.fate != Fate::Denied).then_some(self.answered - upstream_secs)
    }
}

/// Counts of each fate.
struct Totals {
    admitted: usize,
    delayed: usize,
    denied: usize,
}

impl Totals {
    fn of(requests: &[Request]) -> Self {
        let count = |fate| requests.iter().filter(|r| r.fate == fate).count();
        Self { admitted: count(Fate::Admitted), delayed: count(Fate::Delayed), denied: count(Fate::Denied) }
    }
}

impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} offered: {} admitted at once, {} delayed, {} denied",
            self.admitted + self.delayed + self.denied,
            self.admitted,
            self.delayed,
            self.denied
        )
    }
}

/// Sends every request of `plan` at its time, each from its own thread on
/// its own connection, all opened before the start, so that bursts really
/// arrive at once, spread over both of Envoy's workers, and no send waits
/// for another. Waits for every answer; returns them in `plan`'s order.
fn drive(port: u16, plan: &[f64]) -> Result<Vec<Request>, String> {
    let start = aligned_start();
    let mut clients = Vec::with_capacity(plan.len());
    for &at in plan {
        let send_at = start + Duration::from_secs_f64(at);
        clients.push(thread::spawn(move || -> Result<(f64, f64, u16), String> {
            let mut conn = Conn::open(port).map_err(|e| format!("cannot connect to Envoy: {e}"))?;
            sleep_until(send_at);
            let sent = start.elapsed().as_secs_f64();
            let response =
                conn.try_request("GET", "/", &[]).map_err(|e| format!("the request sent at {sent:.3} s: {e}"))?;
            Ok((sent, start.elapsed().as_secs_f64(), response.status))
        }));
    }
    clients
        .into_iter()
        .map(|client| {
            let (sent, answered, status) = client.join().map_err(|_| "a client thread panicked".to_string())??;
            Request::new(sent, answered, status)
        })
        .collect()
}

/// Marks as delayed the `count` admitted requests that took longest: the
/// filter counts how many it delayed but does not say which. Delays are
/// what sets these apart from the other requests, whose time is the
/// upstream's plus a moment (more on a busy machine, so no fixed threshold).
fn mark_delayed(requests: &mut [Request], count: usize) {
    let mut admitted: Vec<&mut Request> = requests.iter_mut().filter(|r| r.fate == Fate::Admitted).collect();
    admitted.sort_by(|a, b| (b.answered - b.sent).total_cmp(&(a.answered - a.sent)));
    for request in admitted.into_iter().take(count) {
        request.fate = Fate::Delayed;
    }
}

/// The next instant, at least half a second away (time to start the
/// clients), when Unix time is a multiple of [`WINDOW`].
fn aligned_start() -> Instant {
    let now = Instant::now();
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
    let window = WINDOW.as_nanos();
    let next = (since_epoch + Duration::from_millis(500).as_nanos()) / window * window + window;
    now + Duration::from_nanos(u64::try_from(next - since_epoch).unwrap_or(0))
}

fn sleep_until(deadline: Instant) {
    if let Some(wait) = deadline.checked_duration_since(Instant::now()) {
        thread::sleep(wait);
    }
}

/// Per bucket of [`BUCKET`] seconds, by send time: admitted, delayed and
/// denied requests.
fn buckets(requests: &[Request], x_max: f64) -> Vec<(f64, Vec<f64>)> {
    let count = (x_max / BUCKET).ceil() as usize;
    let mut bars: Vec<(f64, Vec<f64>)> = (0..count).map(|i| (i as f64 * BUCKET, vec![0.0; 3])).collect();
    for request in requests {
        let index = ((request.sent / BUCKET).floor().max(0.0) as usize).min(count.saturating_sub(1));
        let fate = match request.fate {
            Fate::Admitted => 0,
            Fate::Delayed => 1,
            Fate::Denied => 2,
        };
        if let Some((_, stack)) = bars.get_mut(index) {
            stack[fate] += 1.0;
        }
    }
    bars
}

/// A step line counting `times` as they pass, from 0 at 0 s to `x_max`.
fn cumulative(label: &str, color: &'static str, times: impl Iterator<Item = f64>, x_max: f64) -> Mark {
    let mut times: Vec<f64> = times.collect();
    times.sort_by(f64::total_cmp);
    let mut points = vec![(0.0, 0.0)];
    points.extend(times.iter().enumerate().map(|(i, t)| (*t, (i + 1) as f64)));
    points.push((x_max, times.len() as f64));
    Mark::Line { legend: Legend::new(label, color), points, step: true, dashed: false, width: 2.0, markers: false }
}

/// Admitted requests between their send time and their answer, as steps.
fn in_flight(requests: &[Request]) -> Vec<(f64, f64)> {
    let mut events: Vec<(f64, i64)> =
        requests.iter().filter(|r| r.fate != Fate::Denied).flat_map(|r| [(r.sent, 1), (r.answered, -1)]).collect();
    // At equal times the departure first: the count never overshoots.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut level = 0;
    let mut points = vec![(0.0, 0.0)];
    for (at, change) in events {
        level += change;
        points.push((at, level as f64));
    }
    points
}

/// Every figure's x axis: seconds from the script's start to `x_max`, a
/// tick on each window.
fn time_axis(x_max: f64) -> Axis {
    Axis::new("time (s)", Scale::Fixed { max: x_max, step: WINDOW.as_secs_f64() })
}

/// A dashed horizontal line at `value`.
fn reference(label: String, value: f64, x_max: f64) -> Mark {
    Mark::Line {
        legend: Legend::new(label, BLUE),
        points: vec![(0.0, value), (x_max, value)],
        step: false,
        dashed: true,
        width: 2.0,
        markers: false,
    }
}

/// Every rate case's requests passed to the upstream per second, one small
/// panel each on the same time axis.
fn overview(runs: &[&Run], x_max: f64) -> Figure {
    let panels = runs
        .iter()
        .zip(PALETTE.iter().cycle())
        .map(|(Run { case, requests, .. }, color)| {
            let mut counts = vec![0.0; (x_max / OVERVIEW_BUCKET).ceil() as usize];
            for passed in requests.iter().filter_map(|r| r.passed(case.upstream_secs())) {
                if let Some(count) = counts.get_mut((passed / OVERVIEW_BUCKET) as usize) {
                    *count += 1.0;
                }
            }
            let mut points: Vec<(f64, f64)> =
                counts.iter().enumerate().map(|(i, n)| (i as f64 * OVERVIEW_BUCKET, *n)).collect();
            points.push((x_max, 0.0));
            let mut marks = vec![Mark::Line {
                legend: Legend::new(format!("{}: passed to the upstream", case.name), color),
                points,
                step: true,
                dashed: false,
                width: 2.0,
                markers: false,
            }];
            if let Some((limit, period)) = case.number("limit").zip(case.duration("period")) {
                let per_bucket = limit * OVERVIEW_BUCKET / period;
                marks.push(reference(
                    format!("limit, {} per {OVERVIEW_BUCKET} s", number(per_bucket)),
                    per_bucket,
                    x_max,
                ));
            }
            Panel { y: Axis::new(format!("per {OVERVIEW_BUCKET} s"), Scale::Linear), marks }
        })
        .collect();
    let mut subtitle = vec![describe_script()];
    subtitle.extend(runs.iter().map(|run| format!("{} {}", run.case.name, run.case.rule)));
    Figure {
        title: "The rate algorithms under the same traffic".into(),
        subtitle,
        x: time_axis(x_max),
        plot_height: 70.0,
        panels,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_script_is_a_burst_three_times_the_rate_a_pause_and_a_split_burst() {
        let times = send_times();
        assert_eq!(times.len(), 30 + 150 + 15 + 15);
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(times.iter().filter(|t| **t == 0.0).count(), 30);
        let steady: Vec<f64> = times.iter().copied().filter(|t| (1.0..11.0).contains(t)).collect();
        assert_eq!(steady.len(), 150);
        assert!(times.iter().all(|t| !(11.0..15.9).contains(t)), "the pause");
        assert_eq!(times.last().copied(), Some(16.1));
    }

    #[test]
    fn the_filters_count_of_delayed_requests_marks_the_longest_waits() {
        let mut requests: Vec<Request> = [(0.0, 0.03, 200), (0.0, 0.4, 429), (0.1, 0.3, 200), (0.2, 0.201, 200)]
            .iter()
            .map(|&(sent, answered, status)| Request::new(sent, answered, status).unwrap())
            .collect();
        assert!(Request::new(1.0, 1.1, 503).is_err());
        mark_delayed(&mut requests, 1);
        let fates: Vec<Fate> = requests.iter().map(|r| r.fate).collect();
        assert_eq!(fates, [Fate::Admitted, Fate::Denied, Fate::Delayed, Fate::Admitted], "a denial is never delayed");
        assert_eq!(requests[2].passed(0.0), Some(0.3));
        assert_eq!(requests[1].passed(0.0), None);
        mark_delayed(&mut requests, 5);
        assert_eq!(Totals::of(&requests).delayed, 3, "at most every admitted request");
    }

    #[test]
    fn buckets_and_in_flight_count_each_request_once() {
        let requests = [
            Request::new(0.0, 1.0, 200).unwrap(),
            Request::new(0.1, 1.1, 200).unwrap(),
            Request::new(0.3, 0.3, 429).unwrap(),
            Request::new(1.0, 2.0, 200).unwrap(),
        ];
        let bars = buckets(&requests, 2.0);
        assert_eq!(bars.len(), 8);
        assert_eq!(bars[0], (0.0, vec![2.0, 0.0, 0.0]));
        assert_eq!(bars[1], (0.25, vec![0.0, 0.0, 1.0]));
        assert_eq!(bars[4], (1.0, vec![1.0, 0.0, 0.0]));
        let levels: Vec<f64> = in_flight(&requests).iter().map(|(_, n)| *n).collect();
        // The third admitted request starts as the first ends: never three at once.
        assert_eq!(levels, [0.0, 1.0, 2.0, 1.0, 2.0, 1.0, 0.0]);
    }

    #[test]
    fn durations_read_as_the_configuration_writes_them() {
        assert_eq!(seconds("2s"), Some(2.0));
        assert_eq!(seconds("500ms"), Some(0.5));
        assert_eq!(seconds("1m"), Some(60.0));
        assert_eq!(seconds("2 s"), None);
        assert_eq!(seconds("s"), None);
    }

    #[test]
    fn every_case_is_valid_json_and_named_once() {
        for (i, case) in CASES.iter().enumerate() {
            assert!(case.rule().unwrap()["algorithm"].is_string(), "{}", case.name);
            assert!(CASES[..i].iter().all(|other| other.name != case.name));
        }
    }
}
