//! A PNG summary of a [`RunReport`]: TTFT percentiles per mode, and each mode's hit rate
//! against the infinite and finite oracles (on an axis scaled to them).
//!
//! Text is drawn with plotters' `ab_glyph` renderer from a TrueType file read at run time
//! (default: Debian's `fonts-dejavu-core`), so no fontconfig or freetype is needed. plotters
//! keeps registered fonts in a process-wide table: the first font registered is kept.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use plotters::prelude::*;
use plotters::style::FontStyle;

use super::report::RunReport;

/// Where Debian's `fonts-dejavu-core` puts its sans-serif face.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (1400, 560);

#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("chart font {path}: {detail}")]
    Font { path: PathBuf, detail: String },
    #[error("drawing {path}: {detail}")]
    Draw { path: PathBuf, detail: String },
}

/// Whether our font is in plotters' table (it has no way to ask).
static REGISTERED: Mutex<bool> = Mutex::new(false);

fn register_font(font: &Path) -> Result<(), ChartError> {
    let font_err = |detail: String| ChartError::Font {
        path: font.to_owned(),
        detail,
    };
    let bytes = std::fs::read(font).map_err(|e| font_err(e.to_string()))?;
    let mut registered = REGISTERED.lock().unwrap_or_else(|p| p.into_inner());
    if !*registered {
        // plotters wants `'static` font bytes: loaded once, they live for the process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font(FAMILY, FontStyle::Normal, bytes)
            .map_err(|_| font_err("not a TrueType/OpenType font".to_owned()))?;
        *registered = true;
    }
    Ok(())
}

/// Writes the chart of `report` to `path` (PNG), drawing text with the font file `font`.
pub fn write_chart(report: &RunReport, path: &Path, font: &Path) -> Result<(), ChartError> {
    register_font(font)?;
    draw(report, path).map_err(|detail| ChartError::Draw {
        path: path.to_owned(),
        detail,
    })
}

/// The top of the hit-rate panel's y-axis (its bottom is 0): the largest of the modes' hit
/// rates and the oracles, with 30 % headroom for the legend, rounded up to a multiple of 0.05,
/// within [0.05, 1].
fn hit_rate_axis_top(report: &RunReport) -> f64 {
    let largest = report
        .modes
        .iter()
        .map(|m| m.hit_rate)
        .chain([report.oracle.infinite, report.oracle.finite])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let step = 0.05;
    ((largest * 1.3 / step).ceil() * step).clamp(step, 1.0)
}

fn draw(report: &RunReport, path: &Path) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(SIZE.0 * 3 / 5);
    let modes: Vec<&str> = report.modes.iter().map(|m| m.mode.as_str()).collect();
    let n = modes.len().max(1) as f64;
    let label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-9 && i >= 0.0 && (i as usize) < modes.len() {
            modes[i as usize].to_owned()
        } else {
            String::new()
        }
    };

    // TTFT p50 / p90 / p99 per mode, grouped bars.
    let top = report
        .modes
        .iter()
        .map(|m| m.ttft_ms.p99)
        .fold(1.0, f64::max)
        * 1.3;
    let mut chart = ChartBuilder::on(&left)
        .caption("TTFT per mode (ms)", (FAMILY, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(modes.len().max(1) * 2 + 1)
        .x_label_formatter(&label)
        .label_style((FAMILY, 14))
        .draw()
        .map_err(|e| err(&e))?;
    let series = [("p50", 0), ("p90", 1), ("p99", 2)];
    for (name, k) in series {
        let color = Palette99::pick(k).to_rgba();
        let bars = report.modes.iter().enumerate().map(move |(i, m)| {
            let v = [m.ttft_ms.p50, m.ttft_ms.p90, m.ttft_ms.p99][k];
            let x0 = i as f64 - 0.36 + 0.24 * k as f64;
            Rectangle::new([(x0, 0.0), (x0 + 0.22, v)], color.filled())
        });
        chart
            .draw_series(bars)
            .map_err(|e| err(&e))?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FAMILY, 14))
        .draw()
        .map_err(|e| err(&e))?;

    // Hit rate per mode against the oracles.
    let mut chart = ChartBuilder::on(&right)
        .caption("Prefix-cache hit rate", (FAMILY, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..hit_rate_axis_top(report))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(modes.len().max(1) * 2 + 1)
        .x_label_formatter(&label)
        .label_style((FAMILY, 14))
        .draw()
        .map_err(|e| err(&e))?;
    let bar = BLUE.mix(0.7).filled();
    chart
        .draw_series(report.modes.iter().enumerate().map(|(i, m)| {
            Rectangle::new([(i as f64 - 0.3, 0.0), (i as f64 + 0.3, m.hit_rate)], bar)
        }))
        .map_err(|e| err(&e))?
        .label("hit rate (cached / prompt tokens)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], bar));
    let oracles = [
        ("infinite oracle", report.oracle.infinite, RED),
        ("finite oracle", report.oracle.finite, MAGENTA),
    ];
    for (name, value, color) in oracles {
        chart
            .draw_series(std::iter::once(PathElement::new(
                [(-0.5, value), (n - 0.5, value)],
                color.stroke_width(2),
            )))
            .map_err(|e| err(&e))?
            .label(format!("{name} {value:.3}"))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FAMILY, 14))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::replay::{ModeRecorder, OracleHitRates, RequestSample};

    /// A two-worker report with one mode per hit rate (50 requests each), oracles 0.7 / 0.6.
    fn chart_report(hit_rates: &[f64]) -> RunReport {
        let modes = hit_rates
            .iter()
            .enumerate()
            .map(|(k, rate)| {
                let mut r = ModeRecorder::new(format!("mode_{k}"), [1, 2]);
                for i in 0..50u64 {
                    r.record(RequestSample {
                        request: 0,
                        worker_id: 1 + i % 2,
                        prompt_tokens: 1000,
                        cached_tokens: if rate.is_finite() {
                            (1000.0 * rate) as u64
                        } else {
                            0
                        },
                        output_tokens: 20,
                        ttft: Duration::from_millis(100 + i * (4 - 2 * k.min(1) as u64)),
                        latency: Duration::from_millis(900 + i),
                        selection_latency: None,
                        selection_wait: Duration::ZERO,
                    });
                }
                let mut m = r.finish(Duration::from_secs(10));
                m.hit_rate = *rate;
                m
            })
            .collect();
        RunReport {
            trace: "test".into(),
            requests: 50 * hit_rates.len() as u64,
            workers: 2,
            block_size: 64,
            blocks_per_worker: 1024,
            speedup: 1.0,
            ttft_floor_ms: None,
            session_oracle: None,
            selection_measured: Default::default(),
            oracle: OracleHitRates {
                block_size: 64,
                capacity_blocks: 2048,
                total_blocks: 1000,
                infinite_hit_blocks: 700,
                finite_hit_blocks: 600,
                infinite: 0.7,
                finite: 0.6,
            },
            modes,
        }
    }

    #[test]
    fn writes_a_png() {
        let font = Path::new(DEFAULT_FONT);
        if !font.exists() {
            println!("skipped: {DEFAULT_FONT} is absent (Debian package fonts-dejavu-core)");
            return;
        }
        // Hit rates and oracles near 0.2, as on the conversation trace's start.
        let mut report = chart_report(&[0.15, 0.2]);
        report.oracle.infinite = 0.24;
        report.oracle.finite = 0.21;
        let dir = std::env::temp_dir().join(format!("kvroute-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("report.png");
        write_chart(&report, &path, font).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 1000);
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        if std::env::var_os("KVROUTE_KEEP_CHART").is_none() {
            std::fs::remove_dir_all(dir).unwrap();
        } else {
            println!("chart: {}", path.display());
        }
    }

    #[test]
    fn the_hit_rate_axis_fits_the_data_with_headroom() {
        let report = |hit_rates: &[f64], infinite: f64, finite: f64| {
            let mut r = chart_report(hit_rates);
            r.oracle.infinite = infinite;
            r.oracle.finite = finite;
            r
        };
        let top = |r: &RunReport| hit_rate_axis_top(r);
        // Values and oracles near 0.2: the axis ends at 0.3, not 1.
        let near = report(&[0.18, 0.12], 0.22, 0.2);
        assert!((top(&near) - 0.3).abs() < 1e-9, "{}", top(&near));
        // The largest value (here the infinite oracle) always fits, below the legend.
        for r in [
            &near,
            &report(&[0.5], 0.61, 0.6),
            &report(&[0.01], 0.02, 0.02),
        ] {
            let largest = r.oracle.infinite;
            assert!(top(r) >= largest * 1.3 - 1e-9, "{} for {largest}", top(r));
        }
        assert_eq!(
            top(&report(&[0.0], 0.0, 0.0)),
            0.05,
            "all zero: a small axis"
        );
        assert_eq!(top(&report(&[0.9], 0.95, 0.93)), 1.0, "never above 1");
        assert_eq!(top(&report(&[f64::NAN], 0.3, 0.3)), 0.4);
    }

    #[test]
    fn a_missing_font_is_a_typed_error() {
        let err = register_font(Path::new("/nonexistent/font.ttf")).unwrap_err();
        assert!(matches!(err, ChartError::Font { .. }));
        assert!(err.to_string().contains("/nonexistent/font.ttf"), "{err}");
    }
}
