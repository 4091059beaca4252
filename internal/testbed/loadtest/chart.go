package loadtest

import (
	"cmp"
	"fmt"
	"image/color"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

var scenarioColor = map[Scenario]color.Color{
	Floor:           color.RGBA{R: 0x55, G: 0x55, B: 0x55, A: 0xff},
	NoPrefill:       color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	NoPrefillDuplex: color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	PD:              color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
}

// Charts draws latency against concurrency and overhead against body size
// for zero-latency engines, where the routers' own cost shows most; whole
// (not streamed) answers when measured, else streamed ones.
func (rep *Report) Charts(dir string) error {
	stream := !slices.ContainsFunc(rep.Points, func(p Point) bool { return p.Profile == ZeroLatency.Name && !p.Stream })
	kind := "whole answers"
	if stream {
		kind = "streamed answers"
	}
	pick := func(keep func(Point) bool, x func(Point) float64) []Point {
		var out []Point
		for _, p := range rep.Points {
			if p.Profile == ZeroLatency.Name && p.Stream == stream && keep(p) {
				out = append(out, p)
			}
		}
		slices.SortFunc(out, func(a, b Point) int { return cmp.Compare(x(a), x(b)) })
		return out
	}
	byConc := func(p Point) float64 { return float64(p.Concurrency) }
	bySize := func(p Point) float64 { return float64(p.BodyBytes) }

	lat := plot.New()
	lat.Title.Text = fmt.Sprintf("Latency vs concurrency (%s prompts, zero-latency engines, %s)", size(rep.SweepBody), kind)
	lat.X.Label.Text = "concurrent clients"
	lat.Y.Label.Text = "latency (ms)"
	lat.X.Scale, lat.Y.Scale = plot.LogScale{}, plot.LogScale{}
	lat.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	lat.Legend.Top, lat.Legend.Left = true, true
	var all []Point
	for _, sc := range Scenarios {
		pts := pick(func(p Point) bool { return p.Scenario == sc && p.BodyBytes == rep.SweepBody }, byConc)
		all = append(all, pts...)
		if err := addLines(lat, sc, pts, byConc, func(p Point) (float64, float64) { return max(p.P50Ms, 0.01), max(p.P99Ms, 0.01) }); err != nil {
			return err
		}
	}
	if drawable(all, byConc) {
		lat.X.Tick.Marker = ticks(all, func(p Point) (float64, string) { return float64(p.Concurrency), fmt.Sprint(p.Concurrency) })
		if err := lat.Save(8*vg.Inch, 5*vg.Inch, filepath.Join(dir, "latency-vs-concurrency.png")); err != nil {
			return err
		}
	}

	over := plot.New()
	over.Title.Text = fmt.Sprintf("Added latency over the floor vs prompt size (%d clients, zero-latency engines, %s)", rep.SizeConcurrency, kind)
	over.X.Label.Text = "request body (bytes)"
	over.Y.Label.Text = "added latency (ms)"
	over.X.Scale = plot.LogScale{}
	over.Legend.Top, over.Legend.Left = true, true
	all = nil
	for _, sc := range []Scenario{NoPrefill, NoPrefillDuplex, PD} {
		pts := pick(func(p Point) bool { return p.Scenario == sc && p.Concurrency == rep.SizeConcurrency }, bySize)
		all = append(all, pts...)
		if err := addLines(over, sc, pts, bySize, func(p Point) (float64, float64) { return p.AddedP50Ms, p.AddedP99Ms }); err != nil {
			return err
		}
	}
	if !drawable(all, bySize) {
		return nil
	}
	over.X.Tick.Marker = ticks(all, func(p Point) (float64, string) { return float64(p.BodyBytes), size(p.BodyBytes) })
	over.Add(plotter.NewGrid())
	return over.Save(8*vg.Inch, 5*vg.Inch, filepath.Join(dir, "overhead-vs-size.png"))
}

// addLines draws p50 (solid) and p99 (dashed) of pts against x.
func addLines(p *plot.Plot, sc Scenario, pts []Point, x func(Point) float64, y func(Point) (p50, p99 float64)) error {
	if len(pts) == 0 {
		return nil
	}
	p50, p99 := make(plotter.XYs, len(pts)), make(plotter.XYs, len(pts))
	for i, pt := range pts {
		a, b := y(pt)
		p50[i], p99[i] = plotter.XY{X: x(pt), Y: a}, plotter.XY{X: x(pt), Y: b}
	}
	for _, l := range []struct {
		name string
		xys  plotter.XYs
		dash []vg.Length
	}{{"p50", p50, nil}, {"p99", p99, []vg.Length{vg.Points(4), vg.Points(3)}}} {
		line, points, err := plotter.NewLinePoints(l.xys)
		if err != nil {
			return err
		}
		line.Color, points.Color = scenarioColor[sc], scenarioColor[sc]
		line.Dashes = l.dash
		line.Width = vg.Points(1.5)
		points.Shape = draw.CircleGlyph{}
		p.Add(line, points)
		p.Legend.Add(fmt.Sprintf("%s %s", sc, l.name), line, points)
	}
	return nil
}

// drawable reports whether the points span at least two x values, which a
// log axis needs.
func drawable(pts []Point, x func(Point) float64) bool {
	for _, p := range pts {
		if x(p) != x(pts[0]) {
			return true
		}
	}
	return false
}

// ticks marks the x values the points were measured at.
func ticks(pts []Point, x func(Point) (float64, string)) plot.ConstantTicks {
	var out plot.ConstantTicks
	seen := map[float64]bool{}
	for _, p := range pts {
		v, label := x(p)
		if !seen[v] {
			seen[v] = true
			out = append(out, plot.Tick{Value: v, Label: label})
		}
	}
	slices.SortFunc(out, func(a, b plot.Tick) int { return cmp.Compare(a.Value, b.Value) })
	return out
}
