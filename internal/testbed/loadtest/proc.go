package loadtest

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat CPU times; it is 100
// on every Linux architecture Go supports.
const clockTicks = 100

// CPUSeconds is the user+system CPU time pid has used so far.
func CPUSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may hold spaces; fields count from its ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	utime, err1 := strconv.ParseUint(f[11], 10, 64)
	stime, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime/stime %q %q", pid, f[11], f[12])
	}
	return float64(utime+stime) / clockTicks, nil
}

// rssBytes is pid's resident set size.
func rssBytes(pid int) (int64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no VmRSS", pid)
}

// debugClient reaches the processes' admin and pprof endpoints; Run closes
// its connections when it returns.
var debugClient = &http.Client{Timeout: 2 * time.Minute}

// liveHeap asks a Go process's pprof endpoint to collect garbage and returns
// the heap still in use: memory the process's work actually holds. It
// collects twice, since buffers cached in a sync.Pool survive one collection.
func liveHeap(ctx context.Context, pprofAddr string) (int64, error) {
	if _, err := heapAlloc(ctx, pprofAddr); err != nil {
		return 0, err
	}
	return heapAlloc(ctx, pprofAddr)
}

// heapAlloc collects garbage in the process behind pprofAddr and returns its
// HeapAlloc.
func heapAlloc(ctx context.Context, pprofAddr string) (int64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+pprofAddr+"/debug/pprof/heap?gc=1&debug=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := debugClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "# HeapAlloc = "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("pprof heap: no HeapAlloc in %d bytes", len(b))
}

// peakRSS samples the RSS of pids (0s are skipped) every interval until ctx
// ends and returns each one's largest value and the largest of their sum.
func peakRSS(ctx context.Context, interval time.Duration, pids ...int) (each []int64, sum int64) {
	each = make([]int64, len(pids))
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		var total int64
		for i, pid := range pids {
			if pid == 0 {
				continue
			}
			if rss, err := rssBytes(pid); err == nil {
				each[i] = max(each[i], rss)
				total += rss
			}
		}
		sum = max(sum, total)
		select {
		case <-ctx.Done():
			return each, sum
		case <-t.C:
		}
	}
}

// cpuOf is pid's CPU seconds so far, 0 for no process (or one gone).
func cpuOf(pid int) float64 {
	if pid == 0 {
		return 0
	}
	s, _ := CPUSeconds(pid)
	return s
}
