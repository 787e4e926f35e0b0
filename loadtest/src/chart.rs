//! Charts as SVG (no fonts or native libraries needed): p99.9 latency against
//! throughput for a sweep, one line per target; and p99.9 per second across
//! a run, where spikes show at a glance.

use std::path::Path;

use plotters::prelude::*;

/// One line of a chart: a name and its (x, y) points.
pub type Series = (String, Vec<(f64, f64)>);

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// p99.9 (ms, log scale) against achieved throughput (requests/s).
pub fn latency_vs_throughput(path: &Path, title: &str, series: &[Series]) -> anyhow::Result<()> {
    draw(
        path,
        title,
        "throughput (requests/s)",
        "p99.9 latency (ms)",
        series,
        true,
    )
}

/// p99.9 (ms, log scale) of each one-second window.
pub fn over_time(path: &Path, title: &str, series: &[Series]) -> anyhow::Result<()> {
    draw(
        path,
        title,
        "time (s)",
        "p99.9 latency of the second (ms)",
        series,
        true,
    )
}

fn draw(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    points: bool,
) -> anyhow::Result<()> {
    let error = |e: &dyn std::fmt::Display| anyhow::anyhow!("chart {}: {e}", path.display());
    let all = series.iter().flat_map(|(_, s)| s.iter());
    let x_max = all.clone().map(|p| p.0).fold(1.0, f64::max) * 1.05;
    let y_max = all.clone().map(|p| p.1).fold(0.01, f64::max) * 2.0;
    let y_min = all.map(|p| p.1).filter(|&y| y > 0.0).fold(y_max, f64::min) / 2.0;

    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, (y_min..y_max).log_scale())
        .map_err(|e| error(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| error(&e))?;
    for (i, (name, data)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let data: Vec<(f64, f64)> = data.iter().copied().filter(|p| p.1 > 0.0).collect();
        chart
            .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
            .map_err(|e| error(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        if points {
            chart
                .draw_series(data.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| error(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| error(&e))?;
    root.present().map_err(|e| error(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_are_written_as_svg() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sweep.svg");
        let series = vec![
            (
                "readstates".to_owned(),
                vec![(1_000.0, 0.2), (2_000.0, 0.3), (4_000.0, 2.0)],
            ),
            (
                "baseline".to_owned(),
                vec![(1_000.0, 0.1), (2_000.0, 0.2), (4_000.0, 0.9)],
            ),
        ];
        latency_vs_throughput(&path, "p99.9 vs throughput", &series).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("readstates") && svg.contains("baseline"));
        assert!(svg.matches("<circle").count() >= 6);
    }
}
