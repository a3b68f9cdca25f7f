//! Floodgate's SVG charts, hand-written: panels stacked under one title
//! and lines of explanation, sharing one x axis, each with a y axis and a
//! legend of its own; bars, lines and dots on linear or log scales. What
//! the algorithm plots (`make plots`) and the fleet simulation's plot
//! (`make fleet-sim`) draw, with no plotting dependency.

use std::fmt::Write as _;

const WIDTH: f64 = 960.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 24.0;
const LEGEND_HEIGHT: f64 = 26.0;
const AXIS_HEIGHT: f64 = 40.0;
const TITLE_HEIGHT: f64 = 34.0;
const SUBTITLE_LINE: f64 = 18.0;

/// A name and colour in a panel's legend.
#[derive(Clone, Debug)]
pub struct Legend {
    /// The text.
    pub label: String,
    /// An SVG colour.
    pub color: &'static str,
}

impl Legend {
    /// A legend entry.
    pub fn new(label: impl Into<String>, color: &'static str) -> Self {
        Self { label: label.into(), color }
    }
}

/// What a panel draws.
#[derive(Clone, Debug)]
pub enum Mark {
    /// Stacked bars `width` wide, each at its left edge `x` with its
    /// segments bottom-up, one per entry of `series`.
    Bars { width: f64, series: Vec<Legend>, bars: Vec<(f64, Vec<f64>)> },
    /// A line `width` pixels wide through `points`; a step line holds each
    /// value until the next point; with `markers`, a dot on each point.
    Line { legend: Legend, points: Vec<(f64, f64)>, step: bool, dashed: bool, width: f64, markers: bool },
    /// One dot per point.
    Dots { legend: Legend, points: Vec<(f64, f64)> },
}

impl Mark {
    /// The values the mark reaches along one dimension: a bar's left and
    /// right edges and the top of its stack; a line's or the dots' points.
    fn values(&self, dimension: Dimension) -> Vec<f64> {
        match (self, dimension) {
            (Mark::Bars { width, bars, .. }, Dimension::X) => {
                bars.iter().flat_map(|(left, _)| [*left, left + width]).collect()
            }
            (Mark::Bars { bars, .. }, Dimension::Y) => bars.iter().map(|(_, stack)| stack.iter().sum()).collect(),
            (Mark::Line { points, .. } | Mark::Dots { points, .. }, Dimension::X) => {
                points.iter().map(|(x, _)| *x).collect()
            }
            (Mark::Line { points, .. } | Mark::Dots { points, .. }, Dimension::Y) => {
                points.iter().map(|(_, y)| *y).collect()
            }
        }
    }
}

/// Across (x) or up (y).
#[derive(Clone, Copy, Debug)]
enum Dimension {
    X,
    Y,
}

/// How an axis places values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scale {
    /// From 0 to `max`, a tick every `step`.
    Fixed {
        /// The axis's end.
        max: f64,
        /// Between ticks.
        step: f64,
    },
    /// From 0 to the first tick at or above the highest value, ticks 1, 2
    /// or 5 times a power of ten apart (about five of them).
    Linear,
    /// Whole powers of ten around the positive values, a tick on each;
    /// what is not positive is not drawn.
    Log,
}

/// An axis: its label and scale.
#[derive(Clone, Debug)]
pub struct Axis {
    /// What it counts.
    pub label: String,
    /// How it places values.
    pub scale: Scale,
}

impl Axis {
    /// An axis labelled `label` on `scale`.
    pub fn new(label: impl Into<String>, scale: Scale) -> Self {
        Self { label: label.into(), scale }
    }
}

/// One chart with its own y axis.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The y axis.
    pub y: Axis,
    /// Drawn in order (later on top).
    pub marks: Vec<Mark>,
}

/// A figure: a title, lines of explanation, and panels over the same x axis.
#[derive(Clone, Debug)]
pub struct Figure {
    /// The first line.
    pub title: String,
    /// Smaller lines under the title.
    pub subtitle: Vec<String>,
    /// The x axis every panel shares.
    pub x: Axis,
    /// Pixels of each panel's plot area.
    pub plot_height: f64,
    /// Top to bottom.
    pub panels: Vec<Panel>,
}

impl Figure {
    /// The figure as an SVG document.
    pub fn to_svg(&self) -> String {
        let header = TITLE_HEIGHT + SUBTITLE_LINE * self.subtitle.len() as f64 + 8.0;
        let panel_height = LEGEND_HEIGHT + self.plot_height + AXIS_HEIGHT;
        let height = header + panel_height * self.panels.len() as f64;
        let mut svg = String::new();
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Verdana, sans-serif" font-size="12">"#
        );
        let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="24" font-size="17" font-weight="bold">{}</text>"#,
            escape(&self.title)
        );
        for (i, line) in self.subtitle.iter().enumerate() {
            let y = TITLE_HEIGHT + SUBTITLE_LINE * (i as f64 + 0.5);
            let _ = writeln!(svg, r##"<text x="{LEFT}" y="{y}" fill="#444">{}</text>"##, escape(line));
        }
        for (i, panel) in self.panels.iter().enumerate() {
            self.draw_panel(&mut svg, panel, i, header + panel_height * i as f64);
        }
        svg.push_str("</svg>\n");
        svg
    }

    fn draw_panel(&self, svg: &mut String, panel: &Panel, index: usize, top: f64) {
        let plot_top = top + LEGEND_HEIGHT;
        let plot_bottom = plot_top + self.plot_height;
        let right = WIDTH - RIGHT;
        let xs = Placed::new(
            self.x.scale,
            panel.marks.iter().flat_map(|m| m.values(Dimension::X)),
            LEFT,
            right - LEFT,
            false,
        );
        let ys = Placed::new(
            panel.y.scale,
            panel.marks.iter().flat_map(|m| m.values(Dimension::Y)),
            plot_bottom,
            self.plot_height,
            true,
        );
        let x = |t: f64| xs.at(t);
        let y = |v: f64| ys.at(v);

        self.draw_legend(svg, panel, top);
        // Grid and tick labels.
        for (tick, label) in ys.ticks() {
            let Some(at) = y(tick) else { continue };
            let _ = writeln!(svg, r##"<line x1="{LEFT}" y1="{at:.1}" x2="{right}" y2="{at:.1}" stroke="#e4e4e4"/>"##);
            let _ = writeln!(svg, r#"<text x="{}" y="{:.1}" text-anchor="end">{label}</text>"#, LEFT - 6.0, at + 4.0);
        }
        for (tick, label) in xs.ticks() {
            let Some(at) = x(tick) else { continue };
            let _ = writeln!(
                svg,
                r##"<line x1="{at:.1}" y1="{plot_top}" x2="{at:.1}" y2="{plot_bottom}" stroke="#e4e4e4"/>"##
            );
            let _ =
                writeln!(svg, r#"<text x="{at:.1}" y="{}" text-anchor="middle">{label}</text>"#, plot_bottom + 15.0);
        }
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#444">{}</text>"##,
            (LEFT + right) / 2.0,
            plot_bottom + 31.0,
            escape(&self.x.label)
        );
        let middle = (plot_top + plot_bottom) / 2.0;
        let _ = writeln!(
            svg,
            r#"<text x="16" y="{middle}" text-anchor="middle" transform="rotate(-90 16 {middle})">{}</text>"#,
            escape(&panel.y.label)
        );
        let clip = format!("panel{index}");
        let _ = writeln!(
            svg,
            r#"<clipPath id="{clip}"><rect x="{LEFT}" y="{}" width="{}" height="{}"/></clipPath>"#,
            plot_top - 2.0,
            right - LEFT,
            self.plot_height + 4.0
        );
        let _ = writeln!(svg, r#"<g clip-path="url(#{clip})">"#);
        let mut dots_on_top = String::new();
        for mark in &panel.marks {
            match mark {
                Mark::Bars { width, series, bars } => {
                    // One width for every bar where the axis is linear.
                    let same_width = x(*width).zip(x(0.0)).map(|(end, start)| end - start);
                    for (left, stack) in bars {
                        let (Some(from), Some(to)) = (x(*left), x(left + width)) else { continue };
                        let pixels = (same_width.unwrap_or(to - from) - 1.0).max(1.0);
                        let mut base = 0.0;
                        for (value, legend) in stack.iter().zip(series) {
                            if let (true, Some(low), Some(high)) = (*value > 0.0, y(base), y(base + value)) {
                                let _ = writeln!(
                                    svg,
                                    r#"<rect x="{:.1}" y="{high:.1}" width="{pixels:.1}" height="{:.1}" fill="{}"/>"#,
                                    from + 0.5,
                                    low - high,
                                    legend.color
                                );
                            }
                            base += value;
                        }
                    }
                }
                Mark::Line { legend, points, step, dashed, width, markers } => {
                    let placed: Vec<(f64, f64)> = points.iter().filter_map(|(px, py)| x(*px).zip(y(*py))).collect();
                    let mut path = String::new();
                    for (i, (sx, sy)) in placed.iter().enumerate() {
                        if i == 0 {
                            let _ = write!(path, "M{sx:.1} {sy:.1}");
                        } else if *step {
                            let _ = write!(path, " H{sx:.1} V{sy:.1}");
                        } else {
                            let _ = write!(path, " L{sx:.1} {sy:.1}");
                        }
                    }
                    let dash = if *dashed { r#" stroke-dasharray="7 4""# } else { "" };
                    let _ = writeln!(
                        svg,
                        r#"<path d="{path}" fill="none" stroke="{}" stroke-width="{width}" stroke-opacity="0.9"{dash}/>"#,
                        legend.color
                    );
                    if *markers {
                        // Over the frame, unclipped: a point on an axis's end shows whole.
                        let inside = |(sx, sy): &&(f64, f64)| {
                            (LEFT - 0.5..=right + 0.5).contains(sx) && (plot_top - 0.5..=plot_bottom + 0.5).contains(sy)
                        };
                        for (sx, sy) in placed.iter().filter(inside) {
                            let _ = writeln!(
                                dots_on_top,
                                r#"<circle cx="{sx:.1}" cy="{sy:.1}" r="3" fill="{}"/>"#,
                                legend.color
                            );
                        }
                    }
                }
                Mark::Dots { legend, points } => {
                    for (sx, sy) in points.iter().filter_map(|(px, py)| x(*px).zip(y(*py))) {
                        let _ = writeln!(
                            svg,
                            r#"<circle cx="{sx:.1}" cy="{sy:.1}" r="2.6" fill="{}" fill-opacity="0.75"/>"#,
                            legend.color
                        );
                    }
                }
            }
        }
        let _ = writeln!(svg, "</g>");
        let _ = writeln!(
            svg,
            r##"<rect x="{LEFT}" y="{plot_top}" width="{}" height="{}" fill="none" stroke="#888"/>"##,
            right - LEFT,
            self.plot_height
        );
        svg.push_str(&dots_on_top);
    }

    fn draw_legend(&self, svg: &mut String, panel: &Panel, top: f64) {
        enum Swatch {
            Box,
            Line { dashed: bool },
            Dot,
        }
        let baseline = top + LEGEND_HEIGHT - 9.0;
        let mut at = LEFT;
        for mark in &panel.marks {
            let entries: Vec<(&Legend, Swatch)> = match mark {
                Mark::Bars { series, .. } => series.iter().map(|legend| (legend, Swatch::Box)).collect(),
                Mark::Line { legend, dashed, .. } => vec![(legend, Swatch::Line { dashed: *dashed })],
                Mark::Dots { legend, .. } => vec![(legend, Swatch::Dot)],
            };
            for (legend, swatch) in entries {
                let color = legend.color;
                let middle = baseline - 4.0;
                let _ = match swatch {
                    Swatch::Box => {
                        writeln!(
                            svg,
                            r#"<rect x="{at:.1}" y="{}" width="14" height="12" fill="{color}"/>"#,
                            baseline - 10.0
                        )
                    }
                    Swatch::Line { dashed } => writeln!(
                        svg,
                        r#"<line x1="{at:.1}" y1="{middle}" x2="{:.1}" y2="{middle}" stroke="{color}" stroke-width="2"{}/>"#,
                        at + 16.0,
                        if dashed { r#" stroke-dasharray="5 3""# } else { "" }
                    ),
                    Swatch::Dot => {
                        writeln!(svg, r#"<circle cx="{:.1}" cy="{middle}" r="4" fill="{color}"/>"#, at + 7.0)
                    }
                };
                let _ = writeln!(svg, r#"<text x="{:.1}" y="{baseline}">{}</text>"#, at + 22.0, escape(&legend.label));
                // An estimate of the text's width: the legend is one row.
                at += 22.0 + 7.0 * legend.label.chars().count() as f64 + 18.0;
            }
        }
    }
}

/// An axis laid over pixels: from `start`, `length` pixels across or up.
struct Placed {
    range: Range,
    start: f64,
    length: f64,
    upward: bool,
}

/// The values an axis spans.
enum Range {
    /// From 0 to `max`, ticks `step` apart; `round` when the last tick is
    /// the first at or above the data (so one half-step of slack), not a
    /// caller's end (where only rounding error is).
    Linear { max: f64, step: f64, round: bool },
    /// From 10^`low` to 10^`high`.
    Log { low: i32, high: i32 },
}

impl Placed {
    fn new(scale: Scale, values: impl Iterator<Item = f64>, start: f64, length: f64, upward: bool) -> Placed {
        let range = match scale {
            Scale::Fixed { max, step } => Range::Linear { max, step, round: false },
            Scale::Linear => {
                let (step, max) = axis(values.fold(0.0, f64::max));
                Range::Linear { max, step, round: true }
            }
            Scale::Log => {
                let (low, high) = decades(values);
                Range::Log { low, high }
            }
        };
        Placed { range, start, length, upward }
    }

    /// Where `value` goes; `None` for a value a log axis cannot show.
    fn at(&self, value: f64) -> Option<f64> {
        let fraction = match self.range {
            Range::Linear { max, .. } => value / max,
            Range::Log { low, high } if value > 0.0 => (value.log10() - f64::from(low)) / f64::from(high - low),
            Range::Log { .. } => return None,
        };
        Some(if self.upward { self.start - fraction * self.length } else { self.start + fraction * self.length })
    }

    /// The ticks and their labels.
    fn ticks(&self) -> Vec<(f64, String)> {
        match self.range {
            Range::Linear { max, step, round } => {
                let slack = if round { step / 2.0 } else { 1e-9 };
                let mut ticks = Vec::new();
                let mut tick = 0.0;
                while tick <= max + slack {
                    ticks.push((tick, number(tick)));
                    tick += step;
                }
                ticks
            }
            Range::Log { low, high } => (low..=high).map(|e| (10f64.powi(e), power_of_ten(e))).collect(),
        }
    }
}

/// The whole powers of ten around the positive `values`: at least one
/// decade; 10⁰ to 10¹ when there are none.
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

/// 10^`exponent` as a tick label: written out from 0.001 to 1000000
/// (digits, not a float's rendering), `1e9` or `1e-4` beyond.
fn power_of_ten(exponent: i32) -> String {
    let zeros = |n: i32| "0".repeat(n.unsigned_abs() as usize);
    match exponent {
        0..=6 => format!("1{}", zeros(exponent)),
        -3..=-1 => format!("0.{}1", zeros(exponent + 1)),
        _ => format!("1e{exponent}"),
    }
}

/// A tick step (1, 2 or 5 times a power of ten) giving about five ticks,
/// and the axis maximum: the first tick at or above `highest`.
fn axis(highest: f64) -> (f64, f64) {
    if highest <= 0.0 {
        return (1.0, 1.0);
    }
    let raw = highest / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    (step, (highest / step - 1e-9).ceil().max(1.0) * step)
}

/// A number as a label: whole numbers without a fraction, others to two places.
pub fn number(value: f64) -> String {
    if (value - value.round()).abs() < 1e-9 {
        format!("{}", value.round())
    } else {
        let text = format!("{value:.2}");
        text.trim_end_matches('0').to_string()
    }
}

/// Text made safe for SVG.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_a_round_tick_at_or_above_the_data() {
        assert_eq!(axis(30.0), (10.0, 30.0));
        assert_eq!(axis(31.0), (10.0, 40.0));
        assert_eq!(axis(7.5), (2.0, 8.0));
        assert_eq!(axis(1.25), (0.5, 1.5));
        assert_eq!(axis(0.0), (1.0, 1.0));
    }

    #[test]
    fn labels_and_text_are_plain_and_escaped() {
        assert_eq!(number(2.0), "2");
        assert_eq!(number(1.25), "1.25");
        assert_eq!(number(0.5), "0.5");
        assert_eq!(escape(r#"{"a": 1} <&>"#), "{&quot;a&quot;: 1} &lt;&amp;&gt;");
    }

    #[test]
    fn log_axes_span_whole_decades_around_the_positive_values() {
        assert_eq!(decades([3.0, 2500.0].into_iter()), (0, 4));
        assert_eq!(decades([10.0].into_iter()), (1, 2), "at least one decade");
        assert_eq!(decades([0.0, -5.0].into_iter()), (0, 1), "nothing positive");
        assert_eq!(decades([0.02, 0.0, 50.0].into_iter()), (-2, 2));
        let labels: Vec<String> = [-4, -3, -1, 0, 1, 6, 7].into_iter().map(power_of_ten).collect();
        assert_eq!(labels, ["1e-4", "0.001", "0.1", "1", "10", "1000000", "1e7"]);
        let placed = Placed::new(Scale::Log, [10.0, 1000.0].into_iter(), 100.0, 200.0, false);
        assert_eq!(placed.at(10.0), Some(100.0));
        assert_eq!(placed.at(100.0), Some(200.0));
        assert_eq!(placed.at(1000.0), Some(300.0));
        assert_eq!(placed.at(0.0), None);
        let ticks: Vec<f64> = placed.ticks().into_iter().map(|(tick, _)| tick).collect();
        assert_eq!(ticks, [10.0, 100.0, 1000.0]);
    }

    #[test]
    fn a_log_log_figure_draws_only_its_positive_points() {
        let line = Mark::Line {
            legend: Legend::new("1000 keys", "#1f77b4"),
            points: vec![(10.0, 100.0), (0.0, 5.0), (100.0, 0.0), (1000.0, 10_000.0)],
            step: false,
            dashed: false,
            width: 2.0,
            markers: true,
        };
        let figure = Figure {
            title: "calls".into(),
            subtitle: Vec::new(),
            x: Axis::new("Envoys", Scale::Log),
            plot_height: 300.0,
            panels: vec![Panel { y: Axis::new("calls/s", Scale::Log), marks: vec![line] }],
        };
        let svg = figure.to_svg();
        assert_eq!(svg.matches("<circle").count(), 2, "{svg}");
        let path = svg.lines().find(|l| l.starts_with("<path")).unwrap_or_default();
        assert_eq!((path.matches('M').count(), path.matches(" L").count()), (1, 1), "{path}");
        for label in [">10<", ">100<", ">1000<", ">10000<", ">Envoys<", ">calls/s<", ">1000 keys<"] {
            assert!(svg.contains(label), "{label} in {svg}");
        }
    }
}
