// Command benchratio summarizes the ratios in `go test -bench` output: for every benchmark
// and every metric whose unit names a ratio, allocations per call, a p99 or rows per
// second, the median and the range over the runs.
//
//	go run ./internal/benchsql/benchratio bench.txt
package main

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: benchratio bench.txt")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer f.Close()
	values := map[string][]float64{}
	var order []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 || !strings.HasPrefix(fields[0], "Benchmark") {
			continue
		}
		name := fields[0]
		if i := strings.LastIndex(name, "-"); i > 0 {
			name = name[:i] // the GOMAXPROCS suffix
		}
		for i := 2; i+1 < len(fields); i += 2 {
			unit := fields[i+1]
			if !strings.Contains(unit, "ratio") && !strings.Contains(unit, "allocs/call") &&
				!strings.Contains(unit, "p99") && !strings.Contains(unit, "rows/s") {
				continue
			}
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				continue
			}
			k := name + " " + unit
			if _, ok := values[k]; !ok {
				order = append(order, k)
			}
			values[k] = append(values[k], v)
		}
	}
	fmt.Printf("%-45s %-22s %6s %s\n", "benchmark", "metric", "median", "range (runs)")
	for _, k := range order {
		v := values[k]
		slices.Sort(v)
		med := v[len(v)/2]
		if len(v)%2 == 0 {
			med = (v[len(v)/2-1] + v[len(v)/2]) / 2
		}
		name, unit, _ := strings.Cut(k, " ")
		fmt.Printf("%-45s %-22s %6.2f %.2f–%.2f (%d)\n", name, unit, med, v[0], v[len(v)-1], len(v))
	}
}
