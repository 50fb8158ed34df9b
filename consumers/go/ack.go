package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
)

// RefusedError is the agent's refusal of an acknowledgement: 403, not from the pod's
// address; 404, no drain intent for the pod.
type RefusedError struct {
	Status  int    // the HTTP status
	Message string // the agent's "error", or its answer as it came
}

func (e *RefusedError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.Status, e.Message) }

// noProxy is a client that speaks to the node's agent directly, as the reference kit
// does: a proxy from the pod's environment would neither reach the host's address nor
// be the pod's own address that the agent checks.
var noProxy = &http.Client{Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true}}

// Acknowledge tells the node's agent (agentURL: http://HOST:PORT, its
// --fault-listen) that pod uid has checkpointed: faultline evicts it now instead of
// at its deadline. It must run in that pod: the agent takes it only from the pod's
// own address. nil when taken (202; 200: taken before); a *RefusedError with the
// agent's answer; another error when the agent cannot be reached (ctx bounds the wait).
func Acknowledge(ctx context.Context, agentURL, uid string) error {
	u, err := url.Parse(agentURL)
	if err != nil || u.Scheme != "http" || u.Hostname() == "" {
		return fmt.Errorf("%s: the agent's http://HOST:PORT", agentURL)
	}
	body, _ := json.Marshal(map[string]string{"uid": uid})
	target := (&url.URL{Scheme: "http", Host: u.Host, Path: "/v1/drain/ack"}).String()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, target, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "faultline-consumer")
	resp, err := noProxy.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	answer, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusAccepted {
		return nil
	}
	why := string(answer)
	var refusal struct {
		Error *string `json:"error"`
	}
	if json.Unmarshal(answer, &refusal) == nil && refusal.Error != nil {
		why = *refusal.Error
	}
	return &RefusedError{Status: resp.StatusCode, Message: why}
}
