package cli

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/idemq/idemq/consumer"
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
			Volumes     []string       `yaml:"volumes"`
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
	var forwards [][]string
	var applied bool
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
		if svc.Command[0] == "forward" {
			forwards = append(forwards, svc.Command)
		}
		if path, ok := appliedFile(svc.Command); ok {
			applied = true
			if !slices.Contains(svc.Volumes, "./topology.yaml:"+path+":ro") {
				t.Errorf("service %s applies %s, but does not mount ./topology.yaml there: %v", name, path, svc.Volumes)
			}
		}
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
	if !applied {
		t.Error("no compose service runs topology apply -f with deploy/topology.yaml")
	}
	checkForwardsMatchTopologyFile(t, "docker-compose.yml", forwards)
}

const topologyFilePath = "../../../../deploy/topology.yaml"

// appliedFile is the FILE of `topology apply -f FILE`.
func appliedFile(args []string) (string, bool) {
	if len(args) == 4 && args[0] == "topology" && args[1] == "apply" && (args[2] == "-f" || args[2] == "--file") {
		return args[3], true
	}
	return "", false
}

// The deployment's topology file is valid, and every forward of the deploy
// files consumes one of its work queues with the same topology (the worker
// declares it on connect; another one would be refused) and publishes to
// one of its exchanges.
func checkForwardsMatchTopologyFile(t *testing.T, where string, forwards [][]string) {
	t.Helper()
	d, err := loadTopologyFile(topologyFilePath)
	if err != nil {
		t.Fatalf("deploy/topology.yaml: %v", err)
	}
	if len(forwards) == 0 {
		t.Errorf("%s: no forward", where)
	}
	for _, args := range forwards {
		a := &app{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }}
		cmd, rest, err := a.rootCommand().Find(args)
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.ParseFlags(rest); err != nil {
			t.Fatal(err)
		}
		f := cmd.Flags()
		var tf topologyFlags
		tf.queue, _ = f.GetString("queue")
		tf.maxAttempts, _ = f.GetInt("max-attempts")
		tf.retryInitial, _ = f.GetDuration("retry-initial")
		tf.retryMultiplier, _ = f.GetFloat64("retry-multiplier")
		tf.retryMax, _ = f.GetDuration("retry-max")
		tf.deliveryLimit, _ = f.GetInt("delivery-limit")
		tf.classic, _ = f.GetBool("classic")
		to, _ := f.GetString("to-exchange")
		i := slices.IndexFunc(d.queues, func(q consumer.TopologyConfig) bool { return q.Queue == tf.queue })
		if i < 0 {
			t.Errorf("%s: forward consumes %s, which deploy/topology.yaml does not declare", where, tf.queue)
			continue
		}
		file := consumer.NewTopology(d.queues[i])
		file.Bindings = nil
		if flags := consumer.NewTopology(tf.config()); !reflect.DeepEqual(flags, file) {
			t.Errorf("%s: forward declares %+v, deploy/topology.yaml %+v", where, flags, file)
		}
		if !slices.ContainsFunc(d.exchanges, func(x fileExchange) bool { return x.Name == to }) {
			t.Errorf("%s: forward publishes to %s, which deploy/topology.yaml does not declare", where, to)
		}
	}
}

type k8sContainer struct {
	Name         string   `yaml:"name"`
	Image        string   `yaml:"image"`
	Args         []string `yaml:"args"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
	Env []struct {
		Name  string `yaml:"name"`
		Value string `yaml:"value"`
	} `yaml:"env"`
}

type k8sPodSpec struct {
	Containers     []k8sContainer `yaml:"containers"`
	InitContainers []k8sContainer `yaml:"initContainers"`
	Volumes        []struct {
		Name      string `yaml:"name"`
		ConfigMap struct {
			Name string `yaml:"name"`
		} `yaml:"configMap"`
	} `yaml:"volumes"`
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
	var forwards [][]string
	configMaps := map[string]map[string]string{}
	type mounted struct{ where, configMap, path string }
	var applies []mounted
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
				configMaps[obj.Metadata.Name] = obj.Data
			}
			if obj.Kind == "ConfigMap" && obj.Metadata.Name == "idemq-config" {
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
				if len(c.Args) > 0 && c.Args[0] == "forward" {
					forwards = append(forwards, c.Args)
				}
				if path, ok := appliedFile(c.Args); ok {
					m := mounted{where: where, path: path}
					for _, vm := range c.VolumeMounts {
						for _, v := range pod.Volumes {
							if v.Name == vm.Name && filepath.Dir(path) == vm.MountPath {
								m.configMap = v.ConfigMap.Name
							}
						}
					}
					applies = append(applies, m)
				}
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
	want, err := os.ReadFile(topologyFilePath)
	if err != nil {
		t.Fatal(err)
	}
	if len(applies) == 0 {
		t.Error("no container runs topology apply -f")
	}
	for _, m := range applies {
		data, ok := configMaps[m.configMap]
		switch {
		case m.configMap == "":
			t.Errorf("%s: %s is not mounted from a ConfigMap", m.where, m.path)
		case !ok:
			t.Errorf("%s: ConfigMap %s is in no manifest", m.where, m.configMap)
		case data[filepath.Base(m.path)] != string(want):
			t.Errorf("%s: ConfigMap %s's %s is not a copy of deploy/topology.yaml", m.where, m.configMap, filepath.Base(m.path))
		}
	}
	checkForwardsMatchTopologyFile(t, "deploy/k8s", forwards)
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
