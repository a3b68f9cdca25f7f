//! A hand-written SVG line chart on log-log axes (the approach of
//! `tests/src/bin/plots/chart.rs`, which is a binary's module and not a
//! library): just what the fleet plot needs.

use std::fmt::Write as _;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 6] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];

/// One line: a label and its points (both coordinates positive).
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// `(x, y)` points, drawn in order.
    pub points: Vec<(f64, f64)>,
}

fn decades(values: impl Iterator<Item = f64>) -> (i32, i32) {
    let (mut low, mut high) = (f64::MAX, f64::MIN);
    for v in values.filter(|v| *v > 0.0) {
        low = low.min(v.log10());
        high = high.max(v.log10());
    }
    if low > high {
        return (0, 1);
    }
    let (low, high) = (low.floor() as i32, high.ceil() as i32);
    (low, high.max(low + 1))
}

fn label(exponent: i32) -> String {
    match exponent {
        0..=6 => format!("{}", 10f64.powi(exponent)),
        _ => format!("1e{exponent}"),
    }
}

/// The chart as SVG text: `title`, axis labels, one line per series.
pub fn log_log(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let (x0, x1) = decades(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = decades(series.iter().flat_map(|s| s.points.iter().map(|p| p.1)));
    let (plot_w, plot_h) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
    let x = |v: f64| LEFT + (v.log10() - f64::from(x0)) / f64::from(x1 - x0) * plot_w;
    let y = |v: f64| TOP + plot_h - (v.log10() - f64::from(y0)) / f64::from(y1 - y0) * plot_h;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
    let _ = writeln!(svg, r#"<text x="{}" y="28" font-size="15" text-anchor="middle">{title}</text>"#, WIDTH / 2.0);
    for e in x0..=x1 {
        let px = x(10f64.powi(e));
        let _ =
            writeln!(svg, r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#ddd"/>"##, TOP + plot_h);
        let _ = writeln!(
            svg,
            r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            TOP + plot_h + 18.0,
            label(e)
        );
    }
    for e in y0..=y1 {
        let py = y(10f64.powi(e));
        let _ =
            writeln!(svg, r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#ddd"/>"##, LEFT + plot_w);
        let _ =
            writeln!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, LEFT - 8.0, py + 4.0, label(e));
    }
    let _ =
        writeln!(svg, r#"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{x_label}</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{y_label}</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0
    );
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<String> = s
            .points
            .iter()
            .filter(|p| p.0 > 0.0 && p.1 > 0.0)
            .map(|p| format!("{:.1},{:.1}", x(p.0), y(p.1)))
            .collect();
        let _ =
            writeln!(svg, r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#, points.join(" "));
        for p in s.points.iter().filter(|p| p.0 > 0.0 && p.1 > 0.0) {
            let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#, x(p.0), y(p.1));
        }
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let lx = LEFT + plot_w + 14.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="2"/>"#,
            lx + 24.0
        );
        let _ = writeln!(svg, r#"<text x="{:.1}" y="{:.1}">{}</text>"#, lx + 30.0, ly + 4.0, s.label);
    }
    svg.push_str("</svg>\n");
    svg
}
