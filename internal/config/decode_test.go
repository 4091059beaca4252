package config

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	_ "google.golang.org/protobuf/types/known/durationpb" // registers duration.proto for scalarsMessage

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// scalarsMessage is a message with a field of every kind the decoder
// checks, those pdx's schema does not use (yet) included: the decoder must
// explain them all in the file's terms, never leave one to protojson.
func scalarsMessage(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	type T = descriptorpb.FieldDescriptorProto_Type
	field := func(name string, n int32, typ T, typeName string) *descriptorpb.FieldDescriptorProto {
		f := &descriptorpb.FieldDescriptorProto{Name: &name, Number: &n, Type: typ.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
		if typeName != "" {
			f.TypeName = &typeName
		}
		return f
	}
	list := func(f *descriptorpb.FieldDescriptorProto) *descriptorpb.FieldDescriptorProto {
		f.Label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum()
		return f
	}
	s := func(v string) *string { return &v }
	i := func(v int32) *int32 { return &v }
	file := &descriptorpb.FileDescriptorProto{
		Name:       s("pdx/config/test/scalars.proto"),
		Package:    s("pdx.config.test"),
		Syntax:     s("proto3"),
		Dependency: []string{"google/protobuf/duration.proto"},
		EnumType: []*descriptorpb.EnumDescriptorProto{{Name: s("Mode"), Value: []*descriptorpb.EnumValueDescriptorProto{
			{Name: s("MODE_UNSPECIFIED"), Number: i(0)}, {Name: s("MODE_FAST"), Number: i(1)}, {Name: s("MODE_SAFE"), Number: i(2)},
		}}},
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: s("Scalars"),
			Field: []*descriptorpb.FieldDescriptorProto{
				field("an_int32", 1, descriptorpb.FieldDescriptorProto_TYPE_INT32, ""),
				field("an_int64", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, ""),
				field("a_uint32", 3, descriptorpb.FieldDescriptorProto_TYPE_UINT32, ""),
				field("a_uint64", 4, descriptorpb.FieldDescriptorProto_TYPE_UINT64, ""),
				field("a_sint32", 5, descriptorpb.FieldDescriptorProto_TYPE_SINT32, ""),
				field("a_sint64", 6, descriptorpb.FieldDescriptorProto_TYPE_SINT64, ""),
				field("a_fixed32", 7, descriptorpb.FieldDescriptorProto_TYPE_FIXED32, ""),
				field("a_fixed64", 8, descriptorpb.FieldDescriptorProto_TYPE_FIXED64, ""),
				field("an_sfixed32", 9, descriptorpb.FieldDescriptorProto_TYPE_SFIXED32, ""),
				field("an_sfixed64", 10, descriptorpb.FieldDescriptorProto_TYPE_SFIXED64, ""),
				field("a_double", 11, descriptorpb.FieldDescriptorProto_TYPE_DOUBLE, ""),
				field("a_float", 12, descriptorpb.FieldDescriptorProto_TYPE_FLOAT, ""),
				field("a_bool", 13, descriptorpb.FieldDescriptorProto_TYPE_BOOL, ""),
				field("a_string", 14, descriptorpb.FieldDescriptorProto_TYPE_STRING, ""),
				field("some_bytes", 15, descriptorpb.FieldDescriptorProto_TYPE_BYTES, ""),
				field("a_mode", 16, descriptorpb.FieldDescriptorProto_TYPE_ENUM, ".pdx.config.test.Mode"),
				field("a_duration", 17, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, ".google.protobuf.Duration"),
				field("nested", 18, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, ".pdx.config.test.Scalars"),
				list(field("int32s", 19, descriptorpb.FieldDescriptorProto_TYPE_INT32, "")),
			},
		}},
	}
	fd, err := protodesc.NewFile(file, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().ByName("Scalars")
}

// Every scalar kind: what a value of the right type decodes to, and what a
// wrong one is told: the field path in snake_case, what the field takes,
// what it got, and the YAML line.
func TestDecodeScalarKinds(t *testing.T) {
	md := scalarsMessage(t)
	tests := []struct {
		name, yaml string
		want       string // the message's JSON as protojson writes it
		wantErr    string
	}{
		{name: "int32", yaml: "an_int32: -5", want: `{"anInt32":-5}`},
		{name: "int32 fraction", yaml: "an_int32: 2.5",
			wantErr: "x.yaml:3: nested.an_int32: expected a whole number from -2147483648 to 2147483647, got number 2.5"},
		{name: "int32 too large", yaml: "an_int32: 2147483648",
			wantErr: "x.yaml:3: nested.an_int32: expected a whole number from -2147483648 to 2147483647, got number 2147483648"},
		{name: "int32 quoted", yaml: `an_int32: "5"`,
			wantErr: `x.yaml:3: nested.an_int32: expected a whole number from -2147483648 to 2147483647, got string "5" (write it without quotes)`},
		{name: "int64", yaml: "an_int64: -9223372036854775808", want: `{"anInt64":"-9223372036854775808"}`},
		{name: "int64 too large", yaml: "an_int64: 9223372036854775808",
			wantErr: "x.yaml:3: nested.an_int64: expected a whole number from -9223372036854775808 to 9223372036854775807, got number 9223372036854775808"},
		{name: "uint32", yaml: "a_uint32: 4294967295", want: `{"aUint32":4294967295}`},
		{name: "uint32 negative", yaml: "a_uint32: -1",
			wantErr: "x.yaml:3: nested.a_uint32: expected a whole number from 0 to 4294967295, got number -1"},
		{name: "uint64", yaml: "a_uint64: 18446744073709551615", want: `{"aUint64":"18446744073709551615"}`},
		{name: "uint64 a string", yaml: "a_uint64: lots",
			wantErr: `x.yaml:3: nested.a_uint64: expected a whole number from 0 to 18446744073709551615, got string "lots"`},
		{name: "sint32", yaml: "a_sint32: -3", want: `{"aSint32":-3}`},
		{name: "sint32 fraction", yaml: "a_sint32: 0.5",
			wantErr: "x.yaml:3: nested.a_sint32: expected a whole number from -2147483648 to 2147483647, got number 0.5"},
		{name: "sint64 true", yaml: "a_sint64: true",
			wantErr: "x.yaml:3: nested.a_sint64: expected a whole number from -9223372036854775808 to 9223372036854775807, got true"},
		{name: "fixed32 negative", yaml: "a_fixed32: -2",
			wantErr: "x.yaml:3: nested.a_fixed32: expected a whole number from 0 to 4294967295, got number -2"},
		{name: "fixed64", yaml: "a_fixed64: 7", want: `{"aFixed64":"7"}`},
		{name: "sfixed32 list", yaml: "an_sfixed32: [1]",
			wantErr: "x.yaml:3: nested.an_sfixed32: expected a whole number from -2147483648 to 2147483647, got a list"},
		{name: "sfixed64", yaml: "an_sfixed64: -7", want: `{"anSfixed64":"-7"}`},
		{name: "double", yaml: "a_double: 0.8", want: `{"aDouble":0.8}`},
		{name: "double exponent", yaml: "a_double: 1e-3", want: `{"aDouble":0.001}`},
		{name: "double percentage", yaml: `a_double: "80%"`,
			wantErr: `x.yaml:3: nested.a_double: expected a number, got string "80%" (a fraction: 0.8 for 80%)`},
		{name: "double quoted", yaml: `a_double: "0.8"`,
			wantErr: `x.yaml:3: nested.a_double: expected a number, got string "0.8" (write it without quotes)`},
		{name: "double mapping", yaml: `a_double: {value: 1}`,
			wantErr: `x.yaml:3: nested.a_double: expected a number, got a mapping`},
		{name: "float", yaml: "a_float: 1.5", want: `{"aFloat":1.5}`},
		{name: "float out of range", yaml: "a_float: 1e39",
			wantErr: "x.yaml:3: nested.a_float: expected a number from -3.4028234663852886e+38 to 3.4028234663852886e+38, got number 1e+39"},
		{name: "bool", yaml: "a_bool: true", want: `{"aBool":true}`},
		{name: "bool a word", yaml: `a_bool: "sure"`,
			wantErr: `x.yaml:3: nested.a_bool: expected true or false, got string "sure"`},
		{name: "bool quoted", yaml: `a_bool: "true"`,
			wantErr: `x.yaml:3: nested.a_bool: expected true or false, got string "true" (write it without quotes)`},
		{name: "string", yaml: "a_string: hello", want: `{"aString":"hello"}`},
		{name: "string a number", yaml: "a_string: 12",
			wantErr: "x.yaml:3: nested.a_string: expected a string, got number 12"},
		{name: "string YAML 1.1 boolean", yaml: "a_string: no",
			wantErr: "x.yaml:3: nested.a_string: expected a string, got false (YAML reads a bare yes, no, on, off, y or n as true or false: quote the string)"},
		{name: "bytes", yaml: "some_bytes: aGk=", want: `{"someBytes":"aGk="}`},
		{name: "bytes not base64", yaml: "some_bytes: '***'",
			wantErr: `x.yaml:3: nested.some_bytes: expected base64-encoded bytes, got string "***"`},
		{name: "enum", yaml: "a_mode: safe", want: `{"aMode":"MODE_SAFE"}`},
		{name: "enum protojson's name", yaml: "a_mode: MODE_FAST", want: `{"aMode":"MODE_FAST"}`},
		{name: "enum unknown choice", yaml: "a_mode: quick",
			wantErr: `x.yaml:3: nested.a_mode: "quick" is not "fast" or "safe"`},
		{name: "enum a number", yaml: "a_mode: 1",
			wantErr: `x.yaml:3: nested.a_mode: expected "fast" or "safe", got number 1`},
		{name: "duration", yaml: "a_duration: 1m30s", want: `{"aDuration":"90s"}`},
		{name: "duration no unit", yaml: "a_duration: 30",
			wantErr: `x.yaml:3: nested.a_duration: expected a duration such as "30s", "1m30s" or "250ms", got number 30 (a number needs a unit: s, ms, m, h)`},
		{name: "duration words", yaml: "a_duration: 3 seconds",
			wantErr: `x.yaml:3: nested.a_duration: expected a duration such as "30s", "1m30s" or "250ms", got string "3 seconds"`},
		{name: "list element", yaml: "int32s: [1, 2.5, 3]",
			wantErr: "x.yaml:3: nested.int32s[1]: expected a whole number from -2147483648 to 2147483647, got number 2.5"},
		{name: "misspelt field", yaml: "a_strng: x",
			wantErr: `x.yaml:3: nested.a_strng: unknown field, did you mean "a_string"? (known fields of Scalars: ` +
				"an_int32, an_int64, a_uint32, a_uint64, a_sint32, a_sint64, a_fixed32, a_fixed64, an_sfixed32, an_sfixed64, " +
				"a_double, a_float, a_bool, a_string, some_bytes, a_mode, a_duration, nested, int32s)"},
		{name: "lowerCamel field", yaml: "aString: x",
			wantErr: `x.yaml:3: nested.aString: unknown field, did you mean "a_string"?`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := dynamicpb.NewMessage(md)
			data := "a_string: first line\nnested:\n  " + tt.yaml + "\n"
			d := decodeInto([]byte(data), m)
			errs := append(d.errs, d.choices...)
			if tt.wantErr != "" {
				require.NotEmpty(t, errs)
				require.ErrorContains(t, joinErrors("x.yaml", errs, d.lines), tt.wantErr)
				require.True(t, d.ok, "a wrong value leaves the rest decodable")
				require.Equal(t, "first line", m.Get(md.Fields().ByName("a_string")).String(), "the rest is decoded")
				return
			}
			require.Empty(t, errs)
			require.True(t, d.ok)
			nested := m.Get(md.Fields().ByName("nested")).Message().Interface()
			js, err := protojson.Marshal(nested)
			require.NoError(t, err)
			require.JSONEq(t, tt.want, string(js))
		})
	}
}

// pdx's own fields, as a user meets them: the whole message.
func TestParseErrorsInTheFilesTerms(t *testing.T) {
	tests := []struct {
		name, yaml, want string
	}{
		{"int32 priority", pools(pool("flow_control: {bands: [{priority: 2.5}]}")),
			"config:7: pools[0].flow_control.bands[0].priority: expected a whole number from -2147483648 to 2147483647, got number 2.5"},
		{"double kv_usage", pools(pool(`saturation: {kv_usage: "80%"}`)),
			`config:7: pools[0].saturation.kv_usage: expected a number, got string "80%" (a fraction: 0.8 for 80%)`},
		{"uint64 max_bytes", pools(pool("flow_control: {max_bytes: 1GiB}")),
			`config:7: pools[0].flow_control.max_bytes: expected a whole number from 0 to 18446744073709551615, got string "1GiB"`},
		{"uint32 on its own line", minimal + "max_body_bytes: 16MiB\n",
			`config:7: max_body_bytes: expected a whole number from 0 to 4294967295, got string "16MiB"`},
		{"bool", pools(pool("default: 1")), "config:7: pools[0].default: expected true or false, got number 1"},
		{"enum", pools(pool("on_prefill_failure: retry")), `config:7: pools[0].on_prefill_failure: "retry" is not "fail" or "fallback"`},
		{"duration", pools(pool("eject_duration: 10")),
			`config:7: pools[0].eject_duration: expected a duration such as "30s", "1m30s" or "250ms", got number 10 (a number needs a unit: s, ms, m, h)`},
		{"map value", pools(pool(`connector: none`, `prefill: []`, `decode: []`, "kubernetes: {namespace: a, port: 8000, match_labels: {app.kubernetes.io/name: 3}}")),
			`config:7: pools[0].kubernetes.match_labels["app.kubernetes.io/name"]: expected a string, got number 3`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml))
			require.EqualError(t, err, tt.want, "input:\n%s", tt.yaml)
		})
	}
}

// Every problem at once: wrong values and unknown fields together with
// validation's findings elsewhere in the file, in the file's order; not
// what only follows from a value being left out.
func TestParseReportsEveryProblemAtOnce(t *testing.T) {
	yaml := `max_body_bytes: lots
pools:
- name: a
  models: [m]
  connector: nixl
  prefil: [{address: "10.0.0.1:8000"}]
  decode: [{address: "10.0.0.2:8000"}]
- name: B
  models: [x]
  connector: nixl
  prefill: [{address: "10.0.0.1:8000"}]
  decode: [{address: "10.0.0.2:8000"}]
  saturation: {action: shed}
kv_events: {port: 5557, block_size: 4096}
`
	_, err := Parse([]byte(yaml))
	require.Error(t, err)
	var lines []string
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		lines = append(lines, e.Error())
	}
	require.Equal(t, []string{
		`config:1: max_body_bytes: expected a whole number from 0 to 4294967295, got string "lots"`,
		`config:6: pools[0].prefil: unknown field, did you mean "prefill"? (known fields of Pool: ` + fieldNames((&configv1.Pool{}).ProtoReflect().Descriptor()) + ")",
		`config:8: pools[1].name: "B" must match [a-z0-9-]+`,
		`config:13: pools[1].saturation.action: "shed" is not "queue" or "reject"`,
		`config:14: kv_events.block_size: 4096 exceeds the maximum of 1024`,
	}, lines, "not pools[0].prefill's absence: the misspelling is why")
}

// Lines are found in JSON and through YAML aliases too; a default's
// problem is at the field that holds it.
func TestErrorLines(t *testing.T) {
	tests := []struct {
		name, yaml, want string
	}{
		{"JSON", "{\n\"pools\": [{\"name\": \"p\", \"models\": [\"m\"], \"connector\": \"nixl\",\n" +
			"  \"prefill\": [{\"address\": \"10.0.0.1:1\"}],\n  \"decode\": [{\"address\": \"10.0.0.1:2\"}],\n  \"prefill_timeout\": \"1h\"}]}",
			"config:5: pools[0].prefill_timeout: 1h0m0s exceeds the maximum of 10m0s"},
		{"alias", "base: &b {address: \"10.0.0.1\"}\n", ""}, // refused as unknown below
		{"a default's problem at its parent", "pools:\n- name: p\n  models: [m]\n  connector: nixl\n  kubernetes:\n" +
			"    namespace: a\n    service: s\n    port: 80\n    prefill_role: decode\n",
			`config:5: pools[0].kubernetes.decode_role: "decode" is also prefill_role`},
		{"duplicate key", minimal + "grpc_address: a:1\ngrpc_address: b:1\n", `config:8: key "grpc_address" already set in map`},
		{"syntax", "pools:\n- name: [\n", "config:2: invalid YAML: did not find expected node content"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.want == "" {
				_, err := Parse([]byte(tt.yaml))
				require.ErrorContains(t, err, "config:1: base: unknown field")
				return
			}
			_, err := Parse([]byte(tt.yaml))
			require.ErrorContains(t, err, tt.want, "input:\n%s", tt.yaml)
		})
	}
}

func TestLinesOf(t *testing.T) {
	l := lineIndex([]byte("a:\n  b:\n  - x: 1\n  - &e {y: 2}\n  labels:\n    app.io/name: v\nc: *e\n"))
	for path, want := range map[string]int{
		"a": 1, "a.b": 2, "a.b[0]": 3, "a.b[0].x": 3, "a.b[1].y": 4,
		`a.labels["app.io/name"]`: 6, "c": 7, "c.y": 4,
		"a.b[0].missing": 3, "a.b[7]": 2, "nowhere": 0, "": 0,
	} {
		require.Equal(t, want, l.of(path), path)
	}
	require.Equal(t, 3, l.lineOf(errors.New(`a.b[0].x: too big`)), "a connector's error names its path")
	require.Equal(t, 0, l.lineOf(errors.New(`something without a path`)))
}

func TestScope(t *testing.T) {
	for path, want := range map[string]string{
		"pools[1].decode[0].address": "pools[1]", "pools": "pools", "kv_events.port": "kv_events", "": "",
		`match_labels["a.b"]`: `match_labels["a.b"]`,
	} {
		require.Equal(t, want, scope(path), path)
	}
	require.True(t, within("pools[1].name", "pools"))
	require.True(t, within("pools[1].name", "pools[1]"))
	require.False(t, within("pools[10].name", "pools[1]"))
	require.False(t, within("pools_x", "pools"))
	require.True(t, within("anything", ""))
}

// What only follows from a value left out is not reported with it.
func TestParseLeavesOutConsequences(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string
	}{
		{"a misspelt field in a pool", pools(pool("prefill: []", `prefil: [{address: "10.0.0.1:8000"}]`), pool("name: Q", "models: [q]")), []string{
			`config:7: pools[0].prefil: unknown field, did you mean "prefill"?`,
			`config:8: pools[1].name: "Q" must match [a-z0-9-]+`,
		}},
		{"a wrong-typed field another section names", pools(pool()) + "kv_events: {port: \"5557\"}\n", []string{
			`config:7: kv_events.port: expected a whole number from 0 to 4294967295, got string "5557" (write it without quotes)`,
		}},
		{"a wrong-typed duration others are checked against", pools(pool("prefill_timeout: 1 minute", "prefill_attempt_timeout: 40s")), []string{
			`config:7: pools[0].prefill_timeout: expected a duration such as "30s", "1m30s" or "250ms", got string "1 minute"`,
		}},
		{"a wrong-typed list element", pools(pool("flow_control: {bands: [{priority: high}, {priority: 0}]}")), []string{
			`config:7: pools[0].flow_control.bands[0].priority: expected a whole number`,
		}},
		{"a choice that is none, beside a wrong type", pools(pool("default: 1", "on_prefill_failure: retry")), []string{
			`config:7: pools[0].default: expected true or false, got number 1`,
			`config:8: pools[0].on_prefill_failure: "retry" is not "fail" or "fallback"`,
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.yaml))
			require.Error(t, err)
			problems := err.(interface{ Unwrap() []error }).Unwrap()
			require.Len(t, problems, len(tt.want), "%v", err)
			for i, want := range tt.want {
				require.ErrorContains(t, problems[i], want)
			}
		})
	}
}
