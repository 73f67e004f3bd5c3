//! The cost per key of each batch size, for the crate, the baselines, the peers' scripts
//! and the floor: a log-log line chart in SVG.

use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

use crate::batch::{CRATE, FLOOR, NAIVE, NODE_REDLOCK, PIPELINED, REDISLOCK};

/// The series as (name, colour, points of (keys, microseconds per key)).
type Series = (&'static str, RGBColor, Vec<(f64, f64)>);

fn series(batch: &Value) -> Vec<Series> {
    let cases = batch["cases"].as_array().cloned().unwrap_or_default();
    let points = |algorithm: &str, field: &str| -> Vec<(f64, f64)> {
        cases
            .iter()
            .filter(|c| c["algorithm"] == algorithm)
            .filter_map(|c| Some((c["keys"].as_f64()?, c[field].as_f64()?)))
            .filter(|(_, y)| *y > 0.0)
            .collect()
    };
    vec![
        (NAIVE, RGBColor(204, 102, 0), points(NAIVE, "per_key_us")),
        (
            PIPELINED,
            RGBColor(153, 51, 153),
            points(PIPELINED, "per_key_us"),
        ),
        (
            NODE_REDLOCK,
            RGBColor(0, 153, 102),
            points(NODE_REDLOCK, "per_key_us"),
        ),
        (
            REDISLOCK,
            RGBColor(204, 51, 51),
            points(REDISLOCK, "per_key_us"),
        ),
        (CRATE, RGBColor(0, 102, 204), points(CRATE, "per_key_us")),
        (
            FLOOR,
            RGBColor(110, 110, 110),
            points(CRATE, "server_cpu_per_key_us"),
        ),
    ]
}

/// Draws the chart of `batch` (the results' `batch` section) into `path`.
pub(crate) fn draw(batch: &Value, path: &Path) -> Result<(), String> {
    let series = series(batch);
    let all: Vec<(f64, f64)> = series.iter().flat_map(|(_, _, p)| p.clone()).collect();
    if all.is_empty() {
        return Err("no batch results to plot".to_owned());
    }
    let (y_min, y_max) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), (_, y)| {
        (lo.min(*y), hi.max(*y))
    });
    // Whole decades, so that the axis labels its ends.
    let y_range = 10f64.powf(y_min.log10().floor())..10f64.powf(y_max.log10().ceil());
    let x_range = 0.7f64..150_000f64;

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Acquire + release of one batch on one local Redis: cost per key",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(x_range.log_scale(), y_range.log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("keys in the batch")
        .y_desc("microseconds per key (median)")
        .x_label_formatter(&|x| label(*x))
        .y_label_formatter(&|y| label(*y))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())?;
    for (name, colour, points) in series {
        let style = ShapeStyle {
            color: colour.to_rgba(),
            filled: true,
            stroke_width: 2,
        };
        chart
            .draw_series(LineSeries::new(points.clone(), style))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, style)))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// 1, 10, 100, 1k, 10k, 100k; 0.1, 0.01 for fractions.
fn label(value: f64) -> String {
    if value >= 1_000.0 {
        format!("{}k", value / 1_000.0)
    } else if value >= 1.0 {
        format!("{value}")
    } else {
        format!("{value:.2}")
    }
}
