package replay

import (
	"cmp"
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// policyColors are assigned to pdx's policies in the report's order;
// peerColors to the peer's, which also get a dashed line and triangles so
// that they stand apart from every pdx line.
var (
	policyColors = []color.Color{
		color.RGBA{R: 0x55, G: 0x55, B: 0x55, A: 0xff},
		color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
		color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
		color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
		color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	}
	peerColors = []color.Color{
		color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff},
		color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff},
	}
)

// Charts draws, per trace, TTFT p90 and goodput against the load point
// (round robin's measured busy share), one line per policy.
func (rep *Report) Charts(dir string) error {
	for _, tr := range rep.Traces {
		for _, c := range []struct {
			file, title, y string
			value          func(RunResult) float64
			max            float64 // of the y axis; 0 for the data's
		}{
			{"ttft-p90-vs-load-" + tr.Name + ".png", "TTFT p90 vs load (" + tr.Name + ")", "TTFT p90 (ms)", func(r RunResult) float64 { return r.TTFT.P90 }, 0},
			{"goodput-vs-load-" + tr.Name + ".png", fmt.Sprintf("Goodput vs load (%s; %s)", tr.Name, tr.SLO),
				"goodput (%)", func(r RunResult) float64 { return 100 * r.Goodput }, 100},
		} {
			if err := rep.chart(filepath.Join(dir, c.file), c.title, c.y, c.max, tr.Name, c.value); err != nil {
				return err
			}
		}
	}
	return nil
}

// chart draws value against load for each policy; the legend goes where
// the lines are not: top left for latency (rising), bottom left for
// goodput (falling).
func (rep *Report) chart(path, title, yLabel string, yMax float64, trace string, value func(RunResult) float64) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "load: round-robin prefill busy share (%)"
	p.Y.Label.Text = yLabel
	p.Y.Min = 0
	if yMax > 0 {
		p.Y.Max = yMax
	}
	p.Legend.Top, p.Legend.Left = yMax == 0, true
	p.Add(plotter.NewGrid())
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, r := range rep.Runs {
		if r.Trace == trace {
			lo, hi = min(lo, 100*r.load()), max(hi, 100*r.load())
		}
	}
	if lo <= hi {
		p.X.Min, p.X.Max = lo-5, hi+5
	}
	var pdxLines, peerLines int
	for _, name := range rep.policyOrder() {
		var xys plotter.XYs
		for _, r := range rep.Runs {
			if r.Trace == trace && r.Policy == name {
				xys = append(xys, plotter.XY{X: 100 * r.load(), Y: value(r)})
			}
		}
		if len(xys) == 0 {
			continue
		}
		slices.SortFunc(xys, func(a, b plotter.XY) int { return cmp.Compare(a.X, b.X) })
		line, points, err := plotter.NewLinePoints(xys)
		if err != nil {
			return err
		}
		line.Width = vg.Points(1.5)
		switch {
		case rep.isOracle(name):
			// The yardstick's limit: black, dotted, apart from every router.
			line.Color, points.Color = color.Black, color.Black
			line.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
			points.Shape = draw.BoxGlyph{}
		case rep.isPeer(name):
			c := peerColors[peerLines%len(peerColors)]
			peerLines++
			line.Color, points.Color = c, c
			line.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
			points.Shape, points.Radius = draw.PyramidGlyph{}, vg.Points(4)
		default:
			c := policyColors[pdxLines%len(policyColors)]
			pdxLines++
			line.Color, points.Color = c, c
			points.Shape = draw.CircleGlyph{}
		}
		p.Add(line, points)
		p.Legend.Add(name, line, points)
	}
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}

// load is r's point's load: round robin's busy share there, or the
// share the point was chosen for when round robin did not run
// (Plan.Speedups).
func (r RunResult) load() float64 {
	if r.RRBusyShare > 0 {
		return r.RRBusyShare
	}
	return r.TargetLoad
}

// isOracle reports whether a policy's runs were the oracle's.
func (rep *Report) isOracle(policy string) bool {
	return slices.ContainsFunc(rep.Runs, func(r RunResult) bool { return r.Policy == policy && r.Oracle })
}

// isPeer reports whether a policy's runs were a peer router's.
func (rep *Report) isPeer(policy string) bool {
	return slices.ContainsFunc(rep.Runs, func(r RunResult) bool { return r.Policy == policy && r.VLLMRouter != "" })
}

// policyOrder is the policies in the order they first ran.
func (rep *Report) policyOrder() []string {
	var out []string
	for _, r := range rep.Runs {
		if !slices.Contains(out, r.Policy) {
			out = append(out, r.Policy)
		}
	}
	return out
}
