//go:build tools

// The helm command of the pinned release, built by build.sh (go build helm.sh/helm/v4/cmd/helm).
package tools

import _ "helm.sh/helm/v4/cmd/helm"
