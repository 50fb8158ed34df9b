// etcd, at the version this Kubernetes release pins (go.etcd.io/etcd/server/v3): the
// same entry point as etcd's own main.go.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
