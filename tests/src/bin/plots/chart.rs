//! Hand-written SVG: panels stacked under one title, sharing an x axis in
//! seconds. Just what the figures need, so the driver has no plotting
//! dependency.

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
    /// value until the next point.
    Line { legend: Legend, points: Vec<(f64, f64)>, step: bool, dashed: bool, width: f64 },
    /// One dot per point.
    Dots { legend: Legend, points: Vec<(f64, f64)> },
}

impl Mark {
    /// The highest y the mark reaches.
    fn y_max(&self) -> f64 {
        let highest = |values: &mut dyn Iterator<Item = f64>| values.fold(0.0, f64::max);
        match self {
            Mark::Bars { bars, .. } => highest(&mut bars.iter().map(|(_, stack)| stack.iter().sum())),
            Mark::Line { points, .. } | Mark::Dots { points, .. } => highest(&mut points.iter().map(|(_, y)| *y)),
        }
    }
}

/// One chart with its own y axis.
#[derive(Clone, Debug)]
pub struct Panel {
    /// What the y axis counts.
    pub y_label: String,
    /// Drawn in order (later on top).
    pub marks: Vec<Mark>,
}

/// A figure: a title, lines of explanation, and panels over the same seconds.
#[derive(Clone, Debug)]
pub struct Figure {
    /// The first line.
    pub title: String,
    /// Smaller lines under the title.
    pub subtitle: Vec<String>,
    /// The x axis runs from 0 to this many seconds.
    pub x_max: f64,
    /// Seconds between x ticks.
    pub x_step: f64,
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
        let (y_step, y_max) = axis(panel.marks.iter().map(Mark::y_max).fold(0.0, f64::max));
        let x = |t: f64| LEFT + t / self.x_max * (right - LEFT);
        let y = |v: f64| plot_bottom - v / y_max * self.plot_height;

        self.draw_legend(svg, panel, top);
        // Grid and tick labels.
        let mut tick = 0.0;
        while tick <= y_max + y_step / 2.0 {
            let at = y(tick);
            let _ = writeln!(svg, r##"<line x1="{LEFT}" y1="{at:.1}" x2="{right}" y2="{at:.1}" stroke="#e4e4e4"/>"##);
            let _ = writeln!(
                svg,
                r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                at + 4.0,
                number(tick)
            );
            tick += y_step;
        }
        let mut tick = 0.0;
        while tick <= self.x_max + 1e-9 {
            let at = x(tick);
            let _ = writeln!(
                svg,
                r##"<line x1="{at:.1}" y1="{plot_top}" x2="{at:.1}" y2="{plot_bottom}" stroke="#e4e4e4"/>"##
            );
            let _ = writeln!(
                svg,
                r#"<text x="{at:.1}" y="{}" text-anchor="middle">{}</text>"#,
                plot_bottom + 15.0,
                number(tick)
            );
            tick += self.x_step;
        }
        let _ = writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#444">time (s)</text>"##,
            (LEFT + right) / 2.0,
            plot_bottom + 31.0
        );
        let middle = (plot_top + plot_bottom) / 2.0;
        let _ = writeln!(
            svg,
            r#"<text x="16" y="{middle}" text-anchor="middle" transform="rotate(-90 16 {middle})">{}</text>"#,
            escape(&panel.y_label)
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
        for mark in &panel.marks {
            match mark {
                Mark::Bars { width, series, bars } => {
                    let pixels = (x(*width) - x(0.0) - 1.0).max(1.0);
                    for (left, stack) in bars {
                        let mut base = 0.0;
                        for (value, legend) in stack.iter().zip(series) {
                            if *value > 0.0 {
                                let _ = writeln!(
                                    svg,
                                    r#"<rect x="{:.1}" y="{:.1}" width="{pixels:.1}" height="{:.1}" fill="{}"/>"#,
                                    x(*left) + 0.5,
                                    y(base + value),
                                    y(base) - y(base + value),
                                    legend.color
                                );
                            }
                            base += value;
                        }
                    }
                }
                Mark::Line { legend, points, step, dashed, width } => {
                    let mut path = String::new();
                    for (i, (px, py)) in points.iter().enumerate() {
                        let (sx, sy) = (x(*px), y(*py));
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
                }
                Mark::Dots { legend, points } => {
                    for (px, py) in points {
                        let _ = writeln!(
                            svg,
                            r#"<circle cx="{:.1}" cy="{:.1}" r="2.6" fill="{}" fill-opacity="0.75"/>"#,
                            x(*px),
                            y(*py),
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
}
