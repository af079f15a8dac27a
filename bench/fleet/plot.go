package main

import (
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"os"
	"time"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

var (
	colLimit = color.RGBA{200, 30, 30, 255}
	colFixed = color.RGBA{150, 150, 150, 255}
	colNear  = color.RGBA{30, 90, 200, 255}
	colAxis  = color.RGBA{60, 60, 60, 255}
	colGrid  = color.RGBA{230, 230, 230, 255}
)

const (
	panelW, panelH                     = 900, 230
	marginL, marginR, marginT, marginB = 60, 20, 36, 30
)

// writePNG draws one panel per case: admits in the sliding window over time
// for each sync mode of the case, and the limit.
func writePNG(path string, results []result) error {
	type panel struct {
		name string
		runs []result
	}
	var panels []panel
	for _, r := range results {
		if len(panels) > 0 && panels[len(panels)-1].name == r.Name {
			panels[len(panels)-1].runs = append(panels[len(panels)-1].runs, r)
			continue
		}
		panels = append(panels, panel{name: r.Name, runs: []result{r}})
	}
	img := image.NewRGBA(image.Rect(0, 0, panelW, panelH*len(panels)))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	for i, p := range panels {
		drawPanel(img, image.Rect(0, i*panelH, panelW, (i+1)*panelH), p.name, p.runs)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return png.Encode(f, img)
}

func drawPanel(img *image.RGBA, r image.Rectangle, name string, runs []result) {
	x0, x1 := r.Min.X+marginL, r.Max.X-marginR
	y0, y1 := r.Min.Y+marginT, r.Max.Y-marginB // y0 top
	limit := runs[0].Events
	top := int(limit) * 5 / 4
	n := 0
	for _, run := range runs {
		n = max(n, len(run.Series))
		for _, v := range run.Series {
			top = max(top, v*11/10)
		}
	}
	if n < 2 {
		return
	}
	px := func(i int) int { return x0 + i*(x1-x0)/(n-1) }
	py := func(v int) int { return y1 - v*(y1-y0)/top }
	for v := 0; v <= top; v += gridStep(top) {
		hline(img, x0, x1, py(v), colGrid)
		label(img, r.Min.X+4, py(v)+4, fmt.Sprint(v), colAxis)
	}
	for s := 0; s < n; s += int(5 * time.Second / sampleEvery) {
		label(img, px(s)-8, y1+16, fmt.Sprintf("%ds", int((time.Duration(s)*sampleEvery).Seconds())), colAxis)
	}
	hline(img, x0, x1, y1, colAxis)
	hline(img, x0, x1, py(int(limit)), colLimit)
	legend := name + "   limit " + fmt.Sprint(limit)
	for _, run := range runs {
		c := colNear
		if run.Fixed {
			c = colFixed
		}
		for i := 1; i < len(run.Series); i++ {
			line(img, px(i-1), py(run.Series[i-1]), px(i), py(run.Series[i]), c)
		}
		legend += fmt.Sprintf("   %s: worst %d", run.mode(), run.Worst)
	}
	label(img, x0, r.Min.Y+14, legend, colAxis)
	label(img, x0, r.Min.Y+28, "grey: fixed-interval sync   blue: near-limit mechanisms   red: the limit", colAxis)
}

func gridStep(top int) int {
	for _, s := range []int{1, 2, 5, 10, 20, 50, 100, 200, 250, 500, 1000, 2000, 5000} {
		if top/s <= 5 {
			return s
		}
	}
	return top / 5
}

func hline(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

// line draws a segment (Bresenham), two pixels thick.
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	err := dx + dy
	for {
		img.Set(x0, y0, c)
		img.Set(x0, y0+1, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		if e2 := 2 * err; e2 >= dy {
			err += dy
			x0 += sx
		} else if e2 <= dx {
			err += dx
			y0 += sy
		}
	}
}

func label(img *image.RGBA, x, y int, s string, c color.Color) {
	d := &font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sign(v int) int {
	switch {
	case v > 0:
		return 1
	case v < 0:
		return -1
	}
	return 0
}
