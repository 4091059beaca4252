package config

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"sigs.k8s.io/yaml"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// fieldError is a problem with the value at a field path such as
// "pools[0].decode[1].address".
type fieldError struct {
	path string
	msg  string
	// line is the problem's YAML line, when it has no path to look up.
	line int
}

func (e *fieldError) Error() string {
	if e.path == "" {
		return e.msg
	}
	return e.path + ": " + e.msg
}

// decoded is what decoding a file found.
type decoded struct {
	// errs are the file's problems of shape: malformed YAML, unknown
	// fields, values of the wrong type. Each such value is left out, so
	// that the rest can still be validated.
	errs []error
	// choices are the values that name none of their enum field's
	// choices: such a field is left unset (its default), which no other
	// finding is taken to follow from.
	choices []error
	// ok is whether the message holds the file's sound parts; false when
	// the file could not be read as a mapping at all.
	ok bool
	// lines are the YAML lines of the file's field paths.
	lines lines
}

// decode turns YAML or JSON into a Config without applying defaults.
func decode(data []byte) (*configv1.Config, decoded) {
	cfg := &configv1.Config{}
	return cfg, decodeInto(data, cfg)
}

// decodeInto decodes YAML or JSON into m.
//
// protojson is strict, but its errors carry no field path and name fields
// in lowerCamelCase at a position in the intermediate JSON, so the generic
// JSON is first checked against the message descriptors: that catches
// unknown fields and wrong types of every kind with their paths, and leaves
// them out, so that protojson only converts what is sound.
func decodeInto(data []byte, m proto.Message) decoded {
	// The strict variant rejects duplicate keys instead of keeping the last.
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return decoded{errs: yamlErrors(err)}
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber() // keep numbers exact for range checks
	var tree any
	if err := dec.Decode(&tree); err != nil {
		return decoded{errs: []error{err}}
	}
	d := decoded{lines: lineIndex(data)}
	if tree == nil { // empty document
		d.ok = true
		return d
	}
	c := &checker{}
	tree, ok := c.message(tree, m.ProtoReflect().Descriptor(), "")
	d.errs, d.choices = c.errs, c.choices
	if !ok {
		return d
	}
	if js, err = json.Marshal(tree); err != nil {
		d.errs = append(d.errs, err)
		return d
	}
	if err := protojson.Unmarshal(js, m); err != nil {
		// The checker let through something protojson refuses: a bug of
		// the checker's, reported rather than hidden.
		d.errs = append(d.errs, fmt.Errorf("decoding: %w", err))
		return d
	}
	d.ok = true
	return d
}

// yamlLine finds the "line N: problem" parts of the YAML parser's errors.
var yamlLine = regexp.MustCompile(`line (\d+): (.+)`)

// yamlErrors turns the YAML parser's error (a syntax error, or a list of
// duplicate keys) into one error per problem, each at its line.
func yamlErrors(err error) []error {
	var errs []error
	for _, m := range yamlLine.FindAllStringSubmatch(err.Error(), -1) {
		n, _ := strconv.Atoi(m[1])
		msg := m[2]
		if !strings.HasPrefix(msg, "key ") { // a duplicate key says what it is
			msg = "invalid YAML: " + msg
		}
		errs = append(errs, &fieldError{line: n, msg: msg})
	}
	if len(errs) == 0 {
		return []error{fmt.Errorf("invalid YAML: %w", err)}
	}
	return errs
}

// checker walks generic JSON against a message descriptor, collecting errors.
type checker struct {
	errs    []error
	choices []error // see decoded
}

func (c *checker) fail(path, format string, args ...any) {
	c.errs = append(c.errs, &fieldError{path: path, msg: fmt.Sprintf(format, args...)})
}

// message checks v against md and returns it without the fields that
// failed, with values rewritten into the form protojson takes. ok is false
// when v is not a mapping at all.
func (c *checker) message(v any, md protoreflect.MessageDescriptor, path string) (any, bool) {
	obj, ok := v.(map[string]any)
	if !ok {
		c.fail(path, "expected a mapping (%s), got %s", md.Name(), describe(v))
		return v, false
	}
	for _, key := range slices.Sorted(maps.Keys(obj)) {
		p := key
		if path != "" {
			p = path + "." + key
		}
		// ByName matches only the proto (snake_case) names, not the
		// lowerCamel JSON names protojson would also accept, so the
		// documentation has a single spelling.
		fd := md.Fields().ByName(protoreflect.Name(key))
		if fd == nil {
			c.fail(p, "unknown field%s (known fields of %s: %s)", suggest(key, md), md.Name(), fieldNames(md))
			delete(obj, key)
			continue
		}
		if obj[key] == nil {
			continue // null leaves the field unset, as in protojson
		}
		if obj[key], ok = c.field(obj[key], fd, p); !ok {
			delete(obj, key)
		}
	}
	return obj, true
}

// field checks the value of field fd; ok is false when it cannot be used
// at all.
func (c *checker) field(v any, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	if fd.IsMap() {
		return c.mapField(v, fd, path)
	}
	if !fd.IsList() {
		return c.value(v, fd, path)
	}
	list, ok := v.([]any)
	if !ok {
		c.fail(path, "expected a list, got %s", describe(v))
		return v, false
	}
	for i, elem := range list {
		if list[i], ok = c.value(elem, fd, fmt.Sprintf("%s[%d]", path, i)); !ok {
			// Keep the place, so that the elements after it keep
			// their indexes in validation's messages.
			list[i] = zero(fd)
		}
	}
	return list, true
}

// zero is the JSON of fd's zero value, standing in for a list element
// that failed.
func zero(fd protoreflect.FieldDescriptor) any {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		if fd.Message().FullName() == "google.protobuf.Duration" {
			return "0s"
		}
		return map[string]any{}
	case protoreflect.EnumKind:
		return string(fd.Enum().Values().Get(0).Name())
	case protoreflect.BoolKind:
		return false
	case protoreflect.StringKind, protoreflect.BytesKind:
		return ""
	}
	return json.Number("0")
}

// mapField checks a map field: a mapping whose values are checked as fd's
// map values, each named path["key"] (label keys hold dots and slashes).
func (c *checker) mapField(v any, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	obj, ok := v.(map[string]any)
	if !ok {
		c.fail(path, "expected a mapping, got %s", describe(v))
		return v, false
	}
	for _, key := range slices.Sorted(maps.Keys(obj)) {
		p := fmt.Sprintf("%s[%q]", path, key)
		if obj[key] == nil {
			c.fail(p, "expected a value, got null")
			delete(obj, key)
			continue
		}
		if obj[key], ok = c.value(obj[key], fd.MapValue(), p); !ok {
			delete(obj, key)
		}
	}
	return obj, true
}

// Ranges of the integer kinds, as the messages say them.
var (
	int32Range  = fmt.Sprintf("a whole number from %d to %d", math.MinInt32, math.MaxInt32)
	int64Range  = fmt.Sprintf("a whole number from %d to %d", int64(math.MinInt64), int64(math.MaxInt64))
	uint32Range = fmt.Sprintf("a whole number from 0 to %d", uint32(math.MaxUint32))
	uint64Range = fmt.Sprintf("a whole number from 0 to %d", uint64(math.MaxUint64))
	floatRange  = fmt.Sprintf("a number from %g to %g", -math.MaxFloat32, math.MaxFloat32)
)

// value checks a single (non-list) value of field fd; ok is false when it
// is not one (and the error is recorded).
func (c *checker) value(v any, fd protoreflect.FieldDescriptor, path string) (any, bool) {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		md := fd.Message()
		if md.FullName() == "google.protobuf.Duration" {
			return c.duration(v, path)
		}
		if md.ParentFile().Package() == "google.protobuf" {
			return v, true // other well-known types have special JSON forms
		}
		return c.message(v, md, path)
	case protoreflect.EnumKind:
		return c.enum(v, fd.Enum(), path)
	case protoreflect.StringKind:
		if _, ok := v.(string); !ok {
			c.fail(path, "expected a string, got %s%s", describe(v), yaml11Hint(v))
			return v, false
		}
	case protoreflect.BytesKind:
		if s, ok := v.(string); !ok || !isBase64(s) {
			c.fail(path, "expected base64-encoded bytes, got %s", describe(v))
			return v, false
		}
	case protoreflect.BoolKind:
		if _, ok := v.(bool); !ok {
			c.fail(path, "expected true or false, got %s%s", describe(v), quotedHint(v, func(s string) bool { return s == "true" || s == "false" }))
			return v, false
		}
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return c.integer(v, path, int32Range, func(s string) error { _, err := strconv.ParseInt(s, 10, 32); return err })
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return c.integer(v, path, int64Range, func(s string) error { _, err := strconv.ParseInt(s, 10, 64); return err })
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return c.integer(v, path, uint32Range, func(s string) error { _, err := strconv.ParseUint(s, 10, 32); return err })
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return c.integer(v, path, uint64Range, func(s string) error { _, err := strconv.ParseUint(s, 10, 64); return err })
	case protoreflect.DoubleKind:
		return c.float(v, path, "a number", 64)
	case protoreflect.FloatKind:
		return c.float(v, path, floatRange, 32)
	default:
		c.fail(path, "fields of kind %s are not supported", fd.Kind())
		return v, false
	}
	return v, true
}

// integer checks a whole number that parse reads, as want says.
func (c *checker) integer(v any, path, want string, parse func(string) error) (any, bool) {
	if n, ok := v.(json.Number); ok && parse(n.String()) == nil {
		return v, true
	}
	c.fail(path, "expected %s, got %s%s", want, describe(v), quotedHint(v, func(s string) bool { return parse(s) == nil }))
	return v, false
}

// float checks a number of bits bits, as want says.
func (c *checker) float(v any, path, want string, bits int) (any, bool) {
	parse := func(s string) bool {
		_, err := strconv.ParseFloat(s, bits) // out of range is an error
		return err == nil
	}
	if n, ok := v.(json.Number); ok && parse(n.String()) {
		return v, true
	}
	hint := quotedHint(v, parse)
	if s, ok := v.(string); ok && strings.HasSuffix(s, "%") && parse(strings.TrimSuffix(s, "%")) {
		hint = " (a fraction: 0.8 for 80%)"
	}
	c.fail(path, "expected %s, got %s%s", want, describe(v), hint)
	return v, false
}

// quotedHint says to drop the quotes around a value that would be right
// without them.
func quotedHint(v any, right func(string) bool) string {
	if s, ok := v.(string); ok && right(s) {
		return " (write it without quotes)"
	}
	return ""
}

// yaml11Hint explains a boolean where a string was expected: YAML 1.1,
// which the decoder reads, takes a bare yes, no, on, off, y or n for one.
func yaml11Hint(v any) string {
	if _, ok := v.(bool); ok {
		return ` (YAML reads a bare yes, no, on, off, y or n as true or false: quote the string)`
	}
	return ""
}

func isBase64(s string) bool {
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.URLEncoding, base64.RawStdEncoding, base64.RawURLEncoding} {
		if _, err := enc.DecodeString(s); err == nil {
			return true
		}
	}
	return false
}

// enum takes a choice of an enum field as the file writes it, its value's
// name without the enum's prefix in lower case ("reject" for
// SATURATION_ACTION_REJECT), or the full name protojson writes, and
// rewrites it into the latter. The zero value, *_UNSPECIFIED, is no choice:
// it is what an unset field reads as.
func (c *checker) enum(v any, ed protoreflect.EnumDescriptor, path string) (any, bool) {
	choices := enumChoices(ed)
	if s, ok := v.(string); ok {
		for i, name := range choices {
			if s == name || s == string(ed.Values().Get(i+1).Name()) {
				return string(ed.Values().Get(i + 1).Name()), true
			}
		}
	}
	quoted := make([]string, len(choices))
	for i, name := range choices {
		quoted[i] = strconv.Quote(name)
	}
	list := orList(quoted)
	if s, ok := v.(string); ok {
		c.choices = append(c.choices, &fieldError{path: path, msg: fmt.Sprintf("%q is not %s", s, list)})
	} else {
		c.choices = append(c.choices, &fieldError{path: path, msg: fmt.Sprintf("expected %s, got %s", list, describe(v))})
	}
	return nil, false
}

// orList joins "a", "b" and "c" as `a, b or c`.
func orList(items []string) string {
	if len(items) < 2 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " or " + items[len(items)-1]
}

// enumChoices returns the names the file gives ed's values but the first
// (its *_UNSPECIFIED zero value), in order.
func enumChoices(ed protoreflect.EnumDescriptor) []string {
	values := ed.Values()
	prefix := strings.TrimSuffix(string(values.Get(0).Name()), "UNSPECIFIED")
	names := make([]string, values.Len()-1)
	for i := range names {
		names[i] = strings.ToLower(strings.TrimPrefix(string(values.Get(i+1).Name()), prefix))
	}
	return names
}

// durationWant is what a duration field takes: Go's duration syntax.
const durationWant = `a duration such as "30s", "1m30s" or "250ms"`

// duration accepts Go duration syntax ("1m30s"), a superset of the seconds-only
// protobuf JSON form, and rewrites it into the latter for protojson.
func (c *checker) duration(v any, path string) (any, bool) {
	s, ok := v.(string)
	if !ok {
		hint := ""
		if _, ok := v.(json.Number); ok {
			hint = " (a number needs a unit: s, ms, m, h)"
		}
		c.fail(path, "expected %s, got %s%s", durationWant, describe(v), hint)
		return v, false
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		c.fail(path, "expected %s, got %s", durationWant, describe(v))
		return v, false
	}
	sign, n := "", uint64(d)
	if d < 0 {
		sign, n = "-", -n // in uint64 so that math.MinInt64 negates correctly
	}
	return fmt.Sprintf("%s%d.%09ds", sign, n/1e9, n%1e9), true
}

// suggest names the field of md that key is likely a misspelling of, as
// ", did you mean ..."; empty when none is close.
func suggest(key string, md protoreflect.MessageDescriptor) string {
	norm := func(s string) string { return strings.ToLower(strings.NewReplacer("_", "", "-", "").Replace(s)) }
	best, bestDist := "", 3 // at most two edits
	fields := md.Fields()
	for i := range fields.Len() {
		name := string(fields.Get(i).Name())
		if norm(name) == norm(key) { // lowerCamel or another case
			return fmt.Sprintf(", did you mean %q?", name)
		}
		if d := editDistance(key, name); d < bestDist && d < len(name)/2 {
			best, bestDist = name, d
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(", did you mean %q?", best)
}

// editDistance is the Levenshtein distance between a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func fieldNames(md protoreflect.MessageDescriptor) string {
	fields := md.Fields()
	names := make([]string, fields.Len())
	for i := range names {
		names[i] = string(fields.Get(i).Name())
	}
	return strings.Join(names, ", ")
}

// describe renders a generic JSON value for error messages.
func describe(v any) string {
	switch v := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("string %q", v)
	case json.Number:
		return "number " + v.String()
	case bool:
		return strconv.FormatBool(v)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	default:
		return fmt.Sprintf("%T", v)
	}
}
