package loadtest

import (
	"cmp"
	"fmt"
	"image/color"
	"os"
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
	PeerRoundRobin:  color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	PeerCacheAware:  color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
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
	leg := newLegend()
	var all []Point
	for _, sc := range Scenarios {
		pts := pick(func(p Point) bool { return p.Scenario == sc && p.BodyBytes == rep.SweepBody }, byConc)
		all = append(all, pts...)
		if err := addLines(lat, &leg, sc, pts, byConc, func(p Point) (float64, float64) { return max(p.P50Ms, 0.01), max(p.P99Ms, 0.01) }); err != nil {
			return err
		}
	}
	if drawable(all, byConc) {
		lat.X.Tick.Marker = ticks(all, func(p Point) (float64, string) { return float64(p.Concurrency), fmt.Sprint(p.Concurrency) })
		if err := save(lat, leg, filepath.Join(dir, "latency-vs-concurrency.png")); err != nil {
			return err
		}
	}

	over := plot.New()
	over.Title.Text = fmt.Sprintf("Added latency over the floor vs prompt size (%d clients, zero-latency engines, %s)", rep.SizeConcurrency, kind)
	over.X.Label.Text = "request body (bytes)"
	over.Y.Label.Text = "added latency (ms)"
	over.X.Scale = plot.LogScale{}
	leg = newLegend()
	all = nil
	for _, sc := range Scenarios {
		if sc == Floor {
			continue // the zero line
		}
		pts := pick(func(p Point) bool { return p.Scenario == sc && p.Concurrency == rep.SizeConcurrency }, bySize)
		all = append(all, pts...)
		if err := addLines(over, &leg, sc, pts, bySize, func(p Point) (float64, float64) { return p.AddedP50Ms, p.AddedP99Ms }); err != nil {
			return err
		}
	}
	if !drawable(all, bySize) {
		return nil
	}
	over.X.Tick.Marker = ticks(all, func(p Point) (float64, string) { return float64(p.BodyBytes), size(p.BodyBytes) })
	over.Add(plotter.NewGrid())
	return save(over, leg, filepath.Join(dir, "overhead-vs-size.png"))
}

// p99Dashes is the p99 lines' style; p50's are solid.
var p99Dashes = []vg.Length{vg.Points(4), vg.Points(3)}

// newLegend is a legend keyed first by the lines' styles; addLines adds
// the scenarios' colours.
func newLegend() plot.Legend {
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	for _, k := range []struct {
		name string
		dash []vg.Length
	}{{"p50", nil}, {"p99", p99Dashes}} {
		l := &plotter.Line{LineStyle: draw.LineStyle{Color: color.Black, Width: vg.Points(1.5), Dashes: k.dash}}
		leg.Add(k.name, l)
	}
	return leg
}

// legendWidth is the strip right of the plot that holds the legend, so that
// it hides no line.
const legendWidth = 2.4 * vg.Inch

// save writes p as a PNG with leg beside it.
func save(p *plot.Plot, leg plot.Legend, path string) error {
	const w, h = 8*vg.Inch + legendWidth, 5 * vg.Inch
	c, err := draw.NewFormattedCanvas(w, h, "png")
	if err != nil {
		return err
	}
	dc := draw.New(c)
	p.Draw(draw.Crop(dc, 0, -legendWidth, 0, 0))
	// Level with the top of the plot's data, below its title.
	leg.Draw(draw.Crop(dc, w-legendWidth+vg.Points(8), 0, 0, -p.Title.TextStyle.Height(p.Title.Text)-p.Title.Padding-vg.Points(8)))
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// addLines draws p50 (solid) and p99 (dashed) of pts against x, and keys
// the scenario's colour in leg.
func addLines(p *plot.Plot, leg *plot.Legend, sc Scenario, pts []Point, x func(Point) float64, y func(Point) (p50, p99 float64)) error {
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
	}{{"p50", p50, nil}, {"p99", p99, p99Dashes}} {
		line, points, err := plotter.NewLinePoints(l.xys)
		if err != nil {
			return err
		}
		line.Color, points.Color = scenarioColor[sc], scenarioColor[sc]
		line.Dashes = l.dash
		line.Width = vg.Points(1.5)
		points.Shape = draw.CircleGlyph{}
		p.Add(line, points)
		if l.dash == nil {
			leg.Add(string(sc), line, points)
		}
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
