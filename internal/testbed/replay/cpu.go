package replay

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// CPUUse is the cores each part of the rig used on average over a run: is
// the router, not the simulated engines' capacity, the bottleneck? Router
// is the process in front of the engines: Envoy for pdx's profiles, whose
// pdx runs in this process with the simulators and the load client (so
// Harness is their sum), and vllm-router for a peer (Harness then has no
// router in it). Machine is every process on the host.
type CPUUse struct {
	Router  float64 `json:"router_cores"`
	Harness float64 `json:"harness_cores"`
	Machine float64 `json:"machine_cores"`
	Cores   int     `json:"machine_cpus"`
	// RouterMsPerRequest is Router's CPU time per request: all of a
	// peer's routing, only Envoy's share of pdx's.
	RouterMsPerRequest float64 `json:"router_cpu_ms_per_request"`
}

// cpuMeter holds the counters at a run's start.
type cpuMeter struct {
	routerPid             int
	start                 time.Time
	router, self, machine float64
	routerOK, machineOK   bool
}

func startCPU(routerPid int) *cpuMeter {
	m := &cpuMeter{routerPid: routerPid, start: time.Now(), self: selfCPU()}
	m.router, m.routerOK = procCPU(routerPid)
	m.machine, m.machineOK = machineCPU()
	return m
}

func (m *cpuMeter) stop() CPUUse {
	wall := time.Since(m.start).Seconds()
	u := CPUUse{Harness: (selfCPU() - m.self) / wall, Cores: runtime.NumCPU()}
	if e, ok := procCPU(m.routerPid); ok && m.routerOK {
		u.Router = (e - m.router) / wall
	}
	if c, ok := machineCPU(); ok && m.machineOK {
		u.Machine = (c - m.machine) / wall
	}
	return u
}

// clockTicks is USER_HZ, the unit of /proc CPU times (100 on Linux).
const clockTicks = 100

// selfCPU is this process's user+system CPU seconds.
func selfCPU() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

// procCPU is pid's user+system CPU seconds, from /proc/<pid>/stat.
func procCPU(pid int) (float64, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	i := bytes.LastIndexByte(b, ')') // the command name may hold spaces
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	return float64(ut+st) / clockTicks, err1 == nil && err2 == nil
}

// machineCPU is the host's non-idle CPU seconds, from /proc/stat.
func machineCPU() (float64, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, false
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, false
	}
	var busy uint64
	for i, v := range f[1:] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, false
		}
		if i != 3 && i != 4 && i < 8 { // not idle, not iowait; guest is in user
			busy += n
		}
	}
	return float64(busy) / clockTicks, true
}
