package cli

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"
)

// The deploy files run this binary: their commands, flags and environment
// variables must be the ones it knows, and their images the project's.

const deployImage = "ghcr.io/idemq/idemq:latest"

// knownEnv are the variables the binary reads (besides the standard OTEL_*).
var knownEnv = []string{"IDEMQ_POSTGRES_URL", "IDEMQ_AMQP_URL", "IDEMQ_SCHEMA", "IDEMQ_JAEGER_URL",
	"IDEMQ_LOG_LEVEL", "IDEMQ_LOG_FORMAT", "IDEMQ_CONNECT_TIMEOUT"}

func TestKnownEnvMatchesTheCode(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	used := map[string]bool{}
	re := regexp.MustCompile(`"(IDEMQ_[A-Z_]+)"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			used[m[1]] = true
		}
	}
	for _, name := range knownEnv {
		if !used[name] {
			t.Errorf("%s is listed here but the binary does not read it", name)
		}
	}
}

// checkInvocation fails unless args name an existing subcommand with flags it accepts.
func checkInvocation(t *testing.T, where string, args []string) {
	t.Helper()
	a := &app{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }}
	root := a.rootCommand()
	cmd, rest, err := root.Find(args)
	if err != nil || cmd == root {
		t.Errorf("%s: %v is not an idemq subcommand (%v)", where, args, err)
		return
	}
	if err := cmd.ParseFlags(rest); err != nil {
		t.Errorf("%s: idemq %v: %v", where, args, err)
	}
	if cmd.Runnable() && len(cmd.Flags().Args()) > 0 && cmd.Args != nil {
		if err := cmd.Args(cmd, cmd.Flags().Args()); err != nil {
			t.Errorf("%s: idemq %v: %v", where, args, err)
		}
	}
}

func checkEnv(t *testing.T, where string, names []string, values map[string]string) {
	t.Helper()
	referenced := map[string]bool{}
	for _, v := range values {
		for _, m := range regexp.MustCompile(`\$\(([A-Z_]+)\)`).FindAllStringSubmatch(v, -1) {
			referenced[m[1]] = true
		}
	}
	for _, n := range names {
		if strings.HasPrefix(n, "OTEL_") || slices.Contains(knownEnv, n) || referenced[n] {
			continue
		}
		t.Errorf("%s: environment variable %s is not one the binary reads", where, n)
	}
}

func TestDockerComposeRunsTheBinaryAsItIs(t *testing.T) {
	t.Parallel()
	var doc struct {
		Services map[string]struct {
			Image       string         `yaml:"image"`
			Build       any            `yaml:"build"`
			Command     []string       `yaml:"command"`
			Environment map[string]any `yaml:"environment"`
		} `yaml:"services"`
	}
	b, err := os.ReadFile("../../../../deploy/docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatalf("docker-compose.yml does not parse: %v", err)
	}
	var ours int
	for name, svc := range doc.Services {
		if svc.Image != deployImage {
			continue
		}
		ours++
		if svc.Build == nil {
			t.Errorf("service %s: no build section for %s", name, deployImage)
		}
		if len(svc.Command) == 0 {
			t.Errorf("service %s: no command", name)
			continue
		}
		checkInvocation(t, "compose service "+name, svc.Command)
		env := map[string]string{}
		var names []string
		for k, v := range svc.Environment {
			names = append(names, k)
			s, _ := v.(string)
			env[k] = s
		}
		checkEnv(t, "compose service "+name, names, env)
		if svc.Environment["IDEMQ_POSTGRES_URL"] == nil || svc.Environment["IDEMQ_AMQP_URL"] == nil {
			t.Errorf("service %s: IDEMQ_POSTGRES_URL and IDEMQ_AMQP_URL must be set", name)
		}
	}
	for _, want := range []string{"postgres", "rabbitmq", "jaeger", "worker", "relay"} {
		if _, ok := doc.Services[want]; !ok {
			t.Errorf("docker-compose.yml has no %s service", want)
		}
	}
	if ours < 3 {
		t.Errorf("only %d services run %s", ours, deployImage)
	}
}

type k8sContainer struct {
	Name  string   `yaml:"name"`
	Image string   `yaml:"image"`
	Args  []string `yaml:"args"`
	Env   []struct {
		Name  string `yaml:"name"`
		Value string `yaml:"value"`
	} `yaml:"env"`
}

type k8sPodSpec struct {
	Containers     []k8sContainer `yaml:"containers"`
	InitContainers []k8sContainer `yaml:"initContainers"`
}

type k8sObject struct {
	Kind     string                `yaml:"kind"`
	Metadata struct{ Name string } `yaml:"metadata"`
	Data     map[string]string     `yaml:"data"`
	Spec     struct {
		Template struct {
			Spec k8sPodSpec `yaml:"spec"`
		} `yaml:"template"`
		JobTemplate struct {
			Spec struct {
				Template struct {
					Spec k8sPodSpec `yaml:"spec"`
				} `yaml:"template"`
			} `yaml:"spec"`
		} `yaml:"jobTemplate"`
	} `yaml:"spec"`
}

func TestKubernetesManifestsRunTheBinaryAsItIs(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("../../../../deploy/k8s/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	kinds := map[string]int{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		for {
			var obj k8sObject
			err := dec.Decode(&obj)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s does not parse: %v", f, err)
			}
			kinds[obj.Kind]++
			where := filepath.Base(f) + " " + obj.Kind + "/" + obj.Metadata.Name
			if obj.Kind == "ConfigMap" {
				var names []string
				for k := range obj.Data {
					names = append(names, k)
				}
				checkEnv(t, where, names, obj.Data)
			}
			pod := obj.Spec.Template.Spec
			if obj.Kind == "CronJob" {
				pod = obj.Spec.JobTemplate.Spec.Template.Spec
			}
			for _, c := range append(pod.Containers, pod.InitContainers...) {
				if c.Image != deployImage {
					t.Errorf("%s: container %s runs %q, want %s", where, c.Name, c.Image, deployImage)
					continue
				}
				checkInvocation(t, where, c.Args)
				var names []string
				values := map[string]string{}
				for _, e := range c.Env {
					names = append(names, e.Name)
					values[e.Name] = e.Value
				}
				checkEnv(t, where, names, values)
			}
		}
	}
	for _, want := range []string{"Deployment", "CronJob", "Job"} {
		if kinds[want] == 0 {
			t.Errorf("no %s in deploy/k8s", want)
		}
	}
	if kinds["Deployment"] < 2 {
		t.Errorf("want a worker and a relay Deployment, have %d Deployments", kinds["Deployment"])
	}
}

func TestDockerfileBuildsTheBinary(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../../../deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"CGO_ENABLED=0", "./cmd/idemq", "ENTRYPOINT"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}
