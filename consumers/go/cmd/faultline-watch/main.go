// Command faultline-watch is the Go consumer on the command line, with the flags and
// the lines of consumers/python/faultline_consumer.py:
//
//	faultline-watch --file /config/fault.json [--exit-on-failed]
//	faultline-watch --dir /config --node "$NODE_NAME" [--exit-on-failed] [--device ID]...
//	faultline-watch --file /config/fault.json --pod-uid "$POD_UID" --exit-on-drain
//	faultline-watch --ack "http://$HOST_IP:8082" --pod-uid "$POD_UID"
//	faultline-watch --url "http://$HOST_IP:8082/v1/fault" --write /config/fault.json
//
// One line per device on each change: "<node> <device> <status> <reason or ->", after
// "<node> - unknown verdict-stale" (or no-verdict) while the node's verdict is not
// confirmed, then one per drain intent: "<node> - drain <namespace>/<pod> <evict_after>
// <reason>". "FAILED <node> <device> <reason>" and exit status 3 with
// --exit-on-failed; "DRAIN <namespace>/<pod> evict_after=<time> <reason>" and exit
// status 4 with --exit-on-drain for this pod's intent (--pod-uid, default $POD_UID).
// --ack tells the node's agent this pod has checkpointed: exit 0 taken, 1 refused.
// --url with --write is the follow mode (the sidecar of a restricted namespace): it
// keeps the file a copy of the agent's latest document and exits 0 on SIGTERM.
// Bad arguments exit 2.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"faultline.dev/consumer"
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

type options struct {
	file, dir, url, write, node, podUID, ack string
	devices                                  []string
	interval                                 float64
	exitOnFailed, exitOnDrain                bool
}

// run is the command with its arguments, environment and output; its exit status.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	var o options
	fs := flag.NewFlagSet("faultline-watch", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.file, "file", "", "the node's own fault.json (or the agent's --health-file)")
	fs.StringVar(&o.dir, "dir", "", "the projected shard ConfigMaps (with --node)")
	fs.StringVar(&o.url, "url", "", "follow mode: the agent's /v1/fault (with --write)")
	fs.StringVar(&o.write, "write", "", "follow mode: keep this file the latest document")
	fs.StringVar(&o.node, "node", getenv("NODE_NAME"), "this node (default: $NODE_NAME)")
	fs.Func("device", "only this device (id, UUID or bus id); repeatable", func(s string) error {
		o.devices = append(o.devices, s)
		return nil
	})
	fs.Float64Var(&o.interval, "interval", 0.5, "seconds between looks")
	fs.BoolVar(&o.exitOnFailed, "exit-on-failed", false, "exit 3 once a watched device is failed")
	fs.StringVar(&o.podUID, "pod-uid", getenv("POD_UID"),
		"this pod's UID (default: $POD_UID; the downward API's metadata.uid)")
	fs.BoolVar(&o.exitOnDrain, "exit-on-drain", false,
		"exit 4 once this pod (--pod-uid) is asked to checkpoint before its eviction")
	fs.StringVar(&o.ack, "ack", "", "acknowledge this pod's drain intent (--pod-uid) to its node's "+
		"agent, http://HOST:PORT, and exit: 0 taken, 1 refused")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	usage := func(msg string) int {
		fmt.Fprintf(stderr, "faultline-watch: %s\n", msg)
		fs.Usage()
		return 2
	}
	if fs.NArg() > 0 {
		return usage("unexpected argument " + fs.Arg(0))
	}
	// One source, as the reference kit's argument group.
	sources := 0
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "file", "dir", "url", "ack":
			sources++
		}
	})
	if sources != 1 {
		return usage("one of --file, --dir, --url and --ack")
	}
	if (o.exitOnDrain || o.ack != "") && o.podUID == "" {
		return usage("--exit-on-drain and --ack need --pod-uid or $POD_UID")
	}
	if o.ack != "" {
		return acknowledge(ctx, o, stdout, stderr)
	}
	if o.dir != "" && o.node == "" {
		return usage("--dir needs --node or $NODE_NAME")
	}
	if (o.url != "") != (o.write != "") {
		return usage("--url and --write go together (follow mode)")
	}
	if o.url != "" {
		if o.exitOnFailed || o.exitOnDrain || len(o.devices) > 0 {
			return usage("follow mode only writes the file: --exit-on-failed, --exit-on-drain " +
				"and --device belong to the consumer reading it")
		}
		return follow(ctx, o, stderr, usage)
	}
	if o.interval <= 0 {
		return usage("--interval: seconds, more than 0")
	}
	return watch(ctx, o, stdout, stderr)
}

func acknowledge(ctx context.Context, o options, stdout, stderr io.Writer) int {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := consumer.Acknowledge(ctx, o.ack, o.podUID); err != nil {
		fmt.Fprintf(stderr, "faultline-watch: acknowledgement refused: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "acknowledged %s\n", o.podUID)
	return 0
}

func follow(ctx context.Context, o options, stderr io.Writer, usage func(string) int) int {
	abs, err := filepath.Abs(o.write)
	if err == nil {
		var fi os.FileInfo
		if fi, err = os.Stat(filepath.Dir(abs)); err == nil && !fi.IsDir() {
			err = errors.New("not a directory")
		}
	}
	if err != nil {
		return usage(fmt.Sprintf("--write %s: its directory does not exist", o.write))
	}
	f, err := consumer.NewFollower(o.url, o.write, o.node)
	if err != nil {
		return usage(err.Error())
	}
	f.Log = func(msg string) { fmt.Fprintf(stderr, "faultline-watch: %s\n", msg) }
	// The pod stops: SIGTERM ends the follow mode with status 0.
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	f.Run(ctx)
	return 0
}

func watch(ctx context.Context, o options, stdout, stderr io.Writer) int {
	var w *consumer.Watch
	if o.dir != "" {
		w = consumer.WatchEntry(o.dir, o.node)
	} else {
		w = consumer.WatchFile(o.file)
		w.Node = o.node
	}
	w.Only = o.devices
	w.Interval = time.Duration(o.interval * float64(time.Second))
	w.OnError = func(err error) { fmt.Fprintf(stderr, "faultline-watch: %v\n", err) }
	node := o.node
	if node == "" {
		node = "-"
	}
	for e := range w.Entries(ctx) {
		for _, l := range consumer.Describe(e, node) {
			fmt.Fprintln(stdout, l)
		}
		if e == nil {
			continue
		}
		if failed := e.Failed(); o.exitOnFailed && len(failed) > 0 {
			for _, d := range failed {
				// A document without a node prints as the reference kit prints it.
				fmt.Fprintf(stdout, "FAILED %s %s %s\n", consumer.OrNone(e.Node), d.ID, orDash(d.Reason))
			}
			return 3
		}
		if d := e.DrainFor(o.podUID); o.exitOnDrain && d != nil {
			fmt.Fprintf(stdout, "DRAIN %s/%s evict_after=%s %s\n",
				d.Namespace, d.Pod, consumer.OrNone(d.EvictAfter), orDash(d.Reason))
			return 4
		}
	}
	return 0
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
